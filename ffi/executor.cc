// [Note: the executor boundary] The one place where ffi/ reaches TIDE's executor.
//
// XLA already runs one thread per device, so the in-process virtual cluster here is "threads
// mode" with XLA's threads: every rank of the group has registered its buffers (RankIo) in the
// rendezvous before ExecuteRank() is called, and each rank runs its own per-rank program. The
// executor entry point this needs from csrc/exec/cpu (sched) is, precisely:
//
//   // Runs rank `rank`'s ops of `program` on the calling thread; peers' buffers are reached
//   // through `views` (one per rank, same address space); counters/arena of one call live in
//   // `cluster` (shared by the group's threads, created once per (plan, group)).
//   void tide::cpu::run_rank(const tide::Program& program, int rank,
//                            const std::vector<tide::cpu::RankBuffers>& views,
//                            tide::cpu::ClusterState& cluster, std::chrono::milliseconds timeout);
//   // with RankBuffers holding per-parameter pointers: AG shards in / landing outputs,
//   // RS gradients in / fp32 shard outputs / optional fp32 accumulators (alpha in the call).
//
// Until that lands on `sched`, this build reports UNIMPLEMENTED from every collective call; the
// rendezvous, plans, validation and the JAX face are complete around it.
#include "tide_ffi.h"

namespace tide::xla_ffi {

bool executor_available() { return false; }

std::string executor_description() {
  return "none: the CPU executor (csrc/exec/cpu, branch sched) is not merged into this build";
}

void ExecuteRank(const Plan& plan, const CallSpec& spec, int rank,
                 const std::vector<const RankIo*>& group) {
  (void)plan;
  (void)rank;
  (void)group;
  throw Unimplemented(TIDE_STR_CAT(collective_name(spec.op), ": ", executor_description()));
}

}  // namespace tide::xla_ffi
