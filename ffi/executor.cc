// [Note: the executor boundary] The one place where ffi/ reaches TIDE's executor.
//
// XLA already runs one thread per device, and the rendezvous has every rank's buffers before the
// executor is called. The CPU executor on `sched` (tide/exec_cpu.h, run_cpu) steps all ranks of
// a call list itself, so rank 0 of the group runs the call for every rank (ExecuteGroup) while
// the other device threads wait in the rendezvous; each rank then does its own completion work
// (CompleteRank).
//
// Until csrc/exec/cpu is merged into this branch, every collective call reports UNIMPLEMENTED;
// the rendezvous, plans, validation and the JAX face are complete around it.
#include "tide_ffi.h"

namespace tide::xla_ffi {

bool executor_available() { return false; }

std::string executor_description() {
  return "none: the CPU executor (csrc/exec/cpu, branch sched) is not merged into this build";
}

void ExecuteGroup(const GroupCall& call) {
  throw Unimplemented(TIDE_STR_CAT(collective_name(call.spec.op), ": ", executor_description()));
}

void CompleteRank(const GroupCall& call, int rank) {}

}  // namespace tide::xla_ffi
