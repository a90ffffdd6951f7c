// CPU executor: runs TIDE programs on a virtual cluster over shared memory.
//
// Contract
//   - CpuArena owns one symmetric arena per rank (ArenaSpec::total bytes each, followed by a
//     canary guard) in ONE mapping: process-private memory for ranks-as-threads, or an anonymous
//     shared mapping that the forked ranks inherit for ranks-as-processes (no name: nothing can
//     outlive the processes, whichever of them is killed; [Note: shared-memory lifetime]).
//     Counters live in each arena's "counters" region as lock-free 64-bit atomics, so they work
//     across processes; they persist across calls (epochs, never reset). An arena larger than the
//     memory the mapping can get (physical memory) is refused with PlanError naming its largest
//     region, before anything is mapped ([Note: arena memory check] in exec/cpu/arena.cc).
//   - run_cpu() executes per-rank call lists. Threads mode: `workers` threads each step a fixed
//     subset of ranks. Processes mode: forked children (one per rank up to 64, else subsets) step
//     their ranks and exit with _exit(); user buffers the program writes are bounced through
//     shared memory and copied back. Inside a rank the streams run in a deterministic
//     round-robin interleaving: a stream advances until its head op is an unsatisfied wait.
//   - A wait that passes `timeout_s` throws tide::TimeoutError naming rank, op index and kind,
//     stream, tag, call seq, the counter and its producer. The first failure aborts every rank.
//     After a run the canaries are verified (tide::Error names the rank and region on damage);
//     while it runs, the staging race canary checks every push into and SUM from a staging slot
//     in both modes (exec/cpu/staging_canary.h); a rank process killed from outside fails the
//     call at once, naming its ranks and the signal ([Note: a killed rank process]);
//     a PUT's bytes are checksummed and re-verified by the receiver's ArrivalWait (corruption
//     between delivery and consumption is reported naming both ops).
//   - Bounds: every BufRef is checked against its bound user buffer / arena region; user
//     buffers of another rank are refused (the push rule).
//   - ExecutorOptions::trace (TIDE_DEBUG=1 through with_debug_env()) traces every op per rank to
//     stderr.
//   - Generated calls (Call::generator, [Note: generated programs] in program.h) run in threads mode
//     only: each stream emits its next step when its current one is done, so a rank holds one
//     step per stream, not its program. Their timeouts name rank, stream and the op's position
//     in its stream; producers come from ProgramGenerator::producer (no op tables to scan) and PUTs
//     are not checksummed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tide/bindings.h"
#include "tide/exec_options.h"
#include "tide/program.h"
#include "tide/program_index.h"
#include "tide/program_set.h"
#include "tide/rail.h"

namespace tide {

struct ArenaView;  // exec/cpu/internal.h

// A rank's user buffers for a run: RankBindings (tide/bindings.h).

// What run_cpu / step_ranks take: the executor's options plus the run's own switches.
struct CpuRunOptions : ExecutorOptions {
  bool processes = false;
  bool verify_agreement = true;  // host check that ranks agree on (group, seq, plan) order first
                                 // (off in tests: a disagreement must then time out, named)
  // Fault injection (tests only): a rank pauses for stall_s once it reaches op stall_op of its
  // first call, or stops for good at op dead_op (a dead peer; in processes mode it exits).
  int stall_rank = -1;
  int64_t stall_op = 0;
  double stall_s = 0;
  int dead_rank = -1;
  int64_t dead_op = 0;
  bool peers_remote = false;  // RankExecutor: peers' blocked waits are not visible (messages)
  // RankExecutor: this run's entry-fence number k (0: unfenced). A timeout's message then reads
  // a remote producer's fence counter: a producer that has not started run k is the root.
  uint64_t fence_run = 0;
  // Two-sided programs ([Note: two-sided rails]): the transport of their SEND/RECV groups, and the
  // rail rank of each program rank (null: the same numbers).
  Rail* rail = nullptr;
  const std::vector<int>* rail_ranks = nullptr;
  // Polled by the calling thread about every 20 ms while the ranks run (the faces pass Python's
  // signal check): true stops every rank and the call throws Interrupted.
  std::function<bool()> interrupted;
  // The staging race canary (exec/cpu/staging_canary.h): run_cpu sets one for ranks as threads
  // and as processes alike (its table is a shared mapping of its own, not arena bytes).
  class StagingCanary* canary = nullptr;
};

class CpuArena {
 public:
  CpuArena(int world, const ArenaSpec& spec, bool shared_memory);
  ~CpuArena();
  CpuArena(const CpuArena&) = delete;
  CpuArena& operator=(const CpuArena&) = delete;

  int world() const { return world_; }
  const ArenaSpec& spec() const { return spec_; }
  bool shared_memory() const { return shm_; }
  int64_t bytes_per_rank() const { return spec_.total; }  // measured arena bytes per rank
  uint8_t* region(int rank, BufKind kind) const;
  int64_t region_bytes(BufKind kind) const { return spec_.bytes[static_cast<int>(kind)]; }
  std::atomic<uint64_t>* counters(int rank) const;
  int64_t num_counters() const { return spec_.counters_bytes / 8; }
  void check_canaries() const;  // throws Error naming rank and region
  struct Shared;                // run-wide abort flag and first error (in the mapping)
  Shared* shared() const { return shared_; }
  ArenaView view() const;       // what the op interpreter sees (exec/cpu/internal.h)

 private:
  int world_;
  ArenaSpec spec_;
  bool shm_;
  int64_t stride_ = 0;  // bytes per rank incl. guard
  int64_t shared_bytes_ = 0;
  uint8_t* base_ = nullptr;
  size_t map_bytes_ = 0;
  Shared* shared_ = nullptr;
};

// Runs per_rank[r] (rank r's calls, in order) on `arena`. bindings[r] are rank r's user
// buffers for every call of this run. Throws TimeoutError / Error (see the contract).
void run_cpu(CpuArena& arena, const std::vector<std::vector<Call>>& per_rank,
             std::vector<RankBindings>& bindings, const CpuRunOptions& opt);

// ---------------------------------------------------------------------------------------------
// Ranks as separate processes                                [csrc/exec/cpu/rank_executor.cc]
// ---------------------------------------------------------------------------------------------
// Contract
//   - Every rank's arena is its own segment: a POSIX shared-memory object named by the owning
//     process (e.g. "/tide_<pid>_<hex>", mapped here with shm_open + mmap) or, in-process, a raw
//     address. RankExecutor maps all of them (rank i's arena = segments[i], segment_bytes each)
//     and interprets `regions` (name -> (offset, bytes) from the segment start; names as in
//     MemoryModel: ring0, ring1, resident, stage, staging, outbox, inbox, spare, counters; other
//     names such as "fixed" are kept for landing overrides) as the arena layout.
//   - run() executes ONLY `rank`'s program of a program set for call `seq` with the same op
//     interpreter as run_cpu (step_ranks): it returns once that rank's streams are done. Peers
//     run their own programs in their own processes; waits read counters that peers bump in
//     this rank's "counters" region (release/acquire atomics on shared memory), with the same
//     deadlines and TimeoutError messages (rank, op index and kind, seq). Counters are epochs.
//   - A program that touches a region the layout lacks fails before any data moves (tide::Error
//     naming the region). No canaries: the segments belong to the caller.
//   - Sub-groups (HSDP shard groups): run(..., ranks) runs a program set built for a group of
//     those global ranks (group rank i = ranks[i]), over their segments.
//   - Host isolation: an empty segment name (or a zero address) leaves that rank's arena unmapped
//     (a rank of another node); only two-sided programs (ExecutorOptions::rails = two_sided,
//     set_rail) reach it, through the rail; any other access fails naming the rank.
//   - fence (default on): groups share scratch regions, so each run first waits until every peer
//     it writes into has finished the previous run, and has started the same run where it lands
//     in the peer's ring slot (see [Note: entry fence]); the last counter of region "counters" is
//     the executor's. Every rank must issue the same sequence of runs.
using RegionTable = std::map<std::string, std::pair<int64_t, int64_t>>;  // name -> (offset, bytes)
// The arena layout a region table describes: absent arena kinds get offset -1, counters come
// from "counters"; every region must fit `limit` bytes (< 0: unbounded). `who` prefixes errors.
ArenaSpec arena_layout_from(const RegionTable& regions, int64_t limit, const char* who);

// The entry fence's counter ([Note: entry fence] in exec/cpu/rank_executor.cc): 2k - 1 once this
// rank has started run #k (its caller's prior work done), 2k once run #k has finished. Run #k
// waits for fence_started(k) of every peer it lands in (TIDE-AG into ring slots,
// ProgramUse::lands_in_peers) and for fence_finished(k - 1) of every other peer it writes into.
constexpr uint64_t fence_started(uint64_t k) { return 2 * k - 1; }
constexpr uint64_t fence_finished(uint64_t k) { return 2 * k; }
inline uint64_t fence_target(uint64_t k, bool arrival) { return arrival ? fence_started(k) : fence_finished(k - 1); }
// "to start run #k" / "to finish run #k" for a fence value (a message's words, both executors).
std::string fence_words(uint64_t value);
// What a peer's fence counter says it has reached, in words: "it has started run #3".
std::string fence_reached(uint64_t value);

class RankExecutor {
 public:
  RankExecutor(int rank, const Topology& topo, const std::vector<std::string>& segment_names,
               int64_t segment_bytes, const RegionTable& regions, const ExecutorOptions& opt, bool fence = true);
  RankExecutor(int rank, const Topology& topo, const std::vector<uint8_t*>& segment_bases,
               int64_t segment_bytes, const RegionTable& regions, const ExecutorOptions& opt, bool fence = true);
  ~RankExecutor();
  RankExecutor(const RankExecutor&) = delete;
  RankExecutor& operator=(const RankExecutor&) = delete;

  int rank() const { return rank_; }
  int world() const { return static_cast<int>(bases_.size()); }
  void set_timeout(double timeout_s);  // later runs' deadline (a validated ExecutorOptions::timeout_s)
  Rails rails() const { return opt_.rails; }
  // The transport of two-sided programs' rail groups (ExecutorOptions::rails = two_sided); peers
  // are this executor's ranks.
  void set_rail(std::shared_ptr<Rail> rail);
  // Polled while a run waits (the faces pass Python's signal check): true stops the run, which
  // throws Interrupted ([Note: interrupting a call] in executor.cc).
  void set_interrupt(std::function<bool()> interrupted) { interrupted_ = std::move(interrupted); }
  uint8_t* segment(int r) const { return bases_.at(static_cast<size_t>(r)); }
  // Runs whose entry fence waited for the peers' arrival ([Note: entry fence]).
  uint64_t arrival_fences() const { return arrival_fences_; }
  // set: one Program per group rank; only this rank's runs. A set built with arena= (arena_bound)
  // takes its region layout from its programs instead of the executor's `regions`.
  // ranks: a sub-group's global ranks (group rank i = (*ranks)[i]; nullptr: every rank).
  void run(const ProgramSet& set, int64_t seq, const RankBindings& bindings,
           const std::vector<int>* ranks = nullptr);

 private:
  void init(const RegionTable& regions);
  void unmap_all();
  // Publishes fence_started(k) of this run k and waits for the peers' fence_target; returns k.
  uint64_t entry_fence(const ArenaView& view, const Program& mine, int64_t seq, const ProgramUse& use,
                       const std::vector<int>& members);
  int rank_;
  Topology topo_;
  int64_t segment_bytes_;
  ExecutorOptions opt_;
  bool fence_;
  uint64_t arrival_fences_ = 0;
  std::vector<uint8_t*> bases_;
  std::vector<bool> owned_;  // mapped here (munmap at destruction)
  ArenaSpec layout_;         // from `regions`; absent regions have offset -1
  std::vector<uint8_t> shared_mem_;  // this process's run-wide state (abort flag, first error)
  std::shared_ptr<Rail> rail_;
  std::function<bool()> interrupted_;
  std::mutex mu_;
};

// Arena-aware program options (the FSDP2 adapter's layout):
//   - regions: the caller's arena layout; every program's `arena` spec is rewritten to it (absent
//     regions: offset -1), so RankExecutor::run(..., use_program_layout=true) addresses it.
//   - landing: AG only; the program's ring-slot kind addresses region `landing_region` (any name in
//     regions, e.g. "fixed") from `landing_offset` on; "" keeps ring<slot>. resident_offset: the
//     group's adopted shards start that far into "resident".
//   - counter_base: every counter index (ops, release/done events) is offset by it, so several
//     groups' AG and RS programs share one counters region. Without regions, the programs' own
//     counters region grows to fit when it ends the arena (it does in the fallback layout).
struct ArenaBindOptions {
  const RegionTable* regions = nullptr;
  int landing_kind = -1;  // BufKind of the AG landing (ring0/ring1); -1: none
  std::string landing_region;
  int64_t landing_offset = 0;
  int64_t resident_offset = 0;
  int64_t counter_base = 0;
};
void bind_programs_to_arena(std::vector<Program>& progs, const ArenaBindOptions& opt);

}  // namespace tide
