// The program index: what every consumer of a program set derives from its ops, written once.
//
// Contract
//   - index_programs(set) scans every rank's ops once: the per-stream op lists, the producing
//     (rank, stream, op) of every counter ([Note: single producer] in program.h), and per rank
//     what its program touches (ProgramUse: arena regions of any rank, its own user buffers, the
//     peers whose arenas it writes, whether it uses counters). The static checker, the CPU
//     executors and the CUDA executors read these instead of deriving them again.
//   - Structural faults a built set can carry (an op on a stream its program does not name, a
//     counter outside the set's counters, a user buffer of another rank: the push rule) throw
//     PlanError naming rank and op. The checker reports them as findings instead
//     (index_programs(..., /*strict=*/false) leaves such ops out of `use`).
//   - admit() is the admission check that the executors whose arena layout is not the programs'
//     own (RankExecutor, CudaRankExecutor, CudaExecutor) make before anything runs: each arena
//     region the rank's program addresses exists in the executor's layout, fits the arena and is
//     large enough, and the counters of every program of the set fit region 'counters' (less the
//     executor's entry-fence slot). It throws tide::Error (PlanError for a layout outside the
//     arena) naming the executor, rank, group and region. The CPU virtual cluster (run_cpu)
//     does not call it: its arena is made from the programs' own layout (its run() refuses a set
//     whose layout differs), generated sets have no index to admit, and its interpreter checks
//     every access against the bound buffer or region as it runs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tide/program.h"

namespace tide {

// SIGNAL, CREDIT, EVENT_RECORD and a PUT or RECV with a counter bump a counter.
bool op_produces(const Op& op);

// What one rank's program touches.
struct ProgramUse {
  int64_t arena_end[kNumBufKinds];                  // end byte addressed per arena region, -1: unused
  std::map<std::pair<int, int>, int64_t> user_end;  // (user kind, index; out: -1) -> end byte
  std::vector<int> writes;                          // group ranks (not its own) whose arenas it writes
  std::vector<int> reads;                           // group ranks (not its own) whose arenas it reads
  // The peers its entry fence waits for: those it writes into, and those that read its arena (a
  // pulling peer must be done with this rank's stage before the next run rewrites it).
  std::vector<int> fence_peers;
  // It writes a peer's ring-slot landing (TIDE-AG's pushes), whose readiness is the peer's caller
  // stream's (the slot's previous owner released there): its entry fence waits for the peers'
  // arrival, not only their previous run ([Note: entry fence], tide/exec_cpu.h).
  bool lands_in_peers = false;
  bool uses_counters = false;
  ProgramUse();
};

struct CounterProducer {
  int rank = -1;    // producing rank, -1: none
  int stream = -1;
  int op = -1;      // its first producing op
};

struct ProgramIndex {
  std::vector<std::vector<std::vector<int>>> stream_ops;  // [rank][stream] -> op indices
  std::vector<std::vector<CounterProducer>> producer;     // [owner rank][counter]
  std::vector<ProgramUse> use;                             // [rank]
  // The producer of counter `c` (none: rank -1).
  const CounterProducer& producer_of(const CounterRef& c) const;
};

// strict: structural faults throw PlanError (executors); else they are skipped (the checker,
// which reports them itself).
ProgramIndex index_programs(const std::vector<Program>& progs, bool strict = true);

// The admission of group rank `me`'s program onto `layout` (see the contract). who: "RankExecutor",
// "CudaRankExecutor", ...; global_rank: the rank named in messages; arena_bytes: the arena (or
// segment) size every region must fit (< 0: unbounded); fence: the executor keeps the last
// counter for its entry fence.
void admit(const std::vector<Program>& progs, const ProgramIndex& index, int me, const ArenaSpec& layout,
           const char* who, int global_rank, int64_t arena_bytes, bool fence);

}  // namespace tide
