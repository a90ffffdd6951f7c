// The call runtime: what happens at each call of a group's collectives, written once.
//
// Contract
//   - A GroupSession is one group's per-call state over one executor (CallExecutor below): its
//     plan, its placement in the executor's arena (GroupPlacement), the program sets it runs —
//     built on first use and cached per (collective, bank, alpha, accumulate) —, the call
//     sequence number of each collective and the one bank rule (TIDE-RS call seq uses outbox bank
//     rs_bank(seq) = (seq - 1) mod 2, Algorithm 1), and the CTA budgets its SUM/LAND ops run with:
//     the plan's solver (Eqs. 13-14) unless SessionOptions overrides them. A face hands over
//     buffers (and streams on CUDA) and gets the call's seq back; it computes no bank, counter
//     base, budget or region offset itself.
//   - Counters: every group sharing an arena draws its counter ranges from one CounterSpace, in
//     the same order on every rank (all ranks create their sessions in group order); a session
//     with its own arena lays its collectives' ranges out from 0. A collective's range holds
//     exactly its programs' counters (program_counters).
//   - Executors: each executor kind implements CallExecutor once (runtime_cpu.cc:
//     CpuClusterCallExecutor and CpuRankCallExecutor; exec/cuda/call_executors.cc:
//     CudaClusterCallExecutor and CudaRankCallExecutor). A face's per-rank RankBindingList is
//     converted once, at the call, into RankBindings (tide/bindings.h), the one per-rank binding
//     type every executor below takes. An executor is one arena domain: cluster executors own every rank's arena,
//     rank executors reach peers' arenas through a fabric.
//   - Calls are serialised per session (a mutex); every rank issues its groups' calls in the
//     same collective order (the user model of program.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "tide/bindings.h"
#include "tide/exec_cpu.h"
#include "tide/exec_options.h"
#include "tide/plan.h"
#include "tide/program.h"
#include "tide/program_set.h"
#include "tide/rs_program.h"

namespace tide {

// The outbox/spare bank of TIDE-RS call `seq` (1, 2, ...): b = (seq - 1) mod 2.
int rs_bank(int64_t seq);

// How a session's calls reach an executor.
class CallExecutor {
 public:
  virtual ~CallExecutor() = default;
  virtual int world() const = 0;  // ranks of the fabric / cluster
  // The arena layout the executor gives every group (a shared arena), or null: each program
  // set brings its own (the plan's layout; one session per arena).
  virtual const RegionTable* regions() const { return nullptr; }
  // Runs (CPU) or enqueues (CUDA) call `seq` of `set` for the local ranks (every rank for
  // cluster executors, in `buffers` order; the executor's own for rank executors). members: the
  // set's group ranks as executor ranks, only for a sub-group (empty: the whole executor; the
  // session passes empty for 0..N-1). streams: per local rank, the caller's stream
  // (CUDA; empty: none). Throws PlanError / Error / TimeoutError naming rank, op and seq.
  virtual void run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
                   const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) = 0;
  virtual void synchronize() {}
  // The deadline of later calls' waits (a validated ExecutorOptions::timeout_s).
  virtual void set_timeout(double timeout_s) = 0;
  // How the executor reaches other nodes: a session lowers its programs to the two-sided rail
  // form (lower_two_sided) for an executor with two-sided rails.
  virtual Rails rails() const { return Rails::kOneSided; }
  virtual std::string name() const = 0;  // "cpu-cluster", "cpu-rank", "cuda-cluster", "cuda-rank"
};

// The static checker (I1-I4) over the calls as a session runs them: TIDE-AG over two calls of
// sets[0]; TIDE-RS over three with the banks alternating (sets[b] is bank b). Throws tide::Error
// "TIDE static checker rejected ..." naming the findings.
void check_session_programs(Collective kind, const std::vector<const ProgramSet*>& sets);

// The counters every collective's programs of `plan` use (their num_counters; two-sided rails
// add the lowering's local counters); pull_landing: TIDE-AG's pull programs' ([Note: pull
// landing] in tide/program.h).
int program_counters(const Plan& plan, Collective kind, Rails rails = Rails::kOneSided, bool pull_landing = false);

// Counter slots shared by the groups of one arena (see the contract).
class CounterSpace {
 public:
  // A fresh range for `kind`'s programs of `plan`; returns its first slot.
  int64_t reserve(const Plan& plan, Collective kind, Rails rails = Rails::kOneSided);
  int64_t used() const { return used_; }  // slots reserved so far
  // Bytes of the arena's counters region: every reserved slot, then the rank executors' entry
  // fence, which is the region's last counter (docs/rank_executor.md).
  int64_t region_bytes() const { return 8 * (used_ + 1); }

 private:
  int64_t used_ = 0;
};

struct SessionOptions {
  int sum_ctas = 0;    // > 0: every SUM runs this budget instead of the plan's C_sum (Eq. 13)
  int land_ctas = 0;   // > 0: every LAND runs this budget instead of the plan's C_mc (Eq. 14)
  bool check = false;  // run the static checker (I1-I4) on every new program set
  // TIDE-RS sets generated while they run ([Note: generated programs] in program.h), only the bank
  // a call uses: scale runs on the CPU virtual cluster (threads); no checker, counter base 0.
  bool generate_rs = false;
};

// Where a group sits in its executor's arena, and which collectives it runs.
struct GroupPlacement {
  int32_t group = 0;               // call identity (program.h): (group, seq) agree on every rank
  std::vector<Collective> kinds = {Collective::kAllGather, Collective::kReduceScatter};
  // TIDE-AG.
  int ring_slot = 0;               // the landing ring slot (group g uses g mod 2)
  bool resident = true;            // shards adopted in region 'resident' (no cast only)
  std::string landing_region;      // shared arena: the region the landing lives in ("": ring<slot>)
  int64_t landing_offset = 0;      // from that region's start
  int64_t resident_offset = 0;     // the group's adopted shards from 'resident''s start
  bool multicast = false;          // mark local pushes/scatters multicast-capable (the gated path)
  bool expert_lane = false;        // the L_sub = 1 lane's recursive doubling (App. F)
  // Land in the ranks' own kLanding user buffers by pulling (one node, or several with a cast;
  // [Note: pull landing] in tide/program.h): for faces whose landing is not arena memory.
  bool pull_landing = false;
  // Every collective's first counter (shared arena: from the arena's CounterSpace; own arena:
  // leave at -1 and the session lays them out from 0).
  int64_t counter_base[kNumCollectives] = {-1, -1, -1};
  std::vector<int> members;        // the group's executor ranks (empty, or 0..N-1: the whole executor)
};

class GroupSession {
 public:
  GroupSession(std::shared_ptr<const Plan> plan, std::shared_ptr<CallExecutor> executor, GroupPlacement placement,
               SessionOptions opt = {});

  const Plan& plan() const { return *plan_; }
  const GroupPlacement& placement() const { return placement_; }
  CallExecutor& executor() const { return *executor_; }
  // The CTA budgets this session's SUM and LAND ops run with.
  int sum_ctas() const { return sum_ctas_; }
  int land_ctas() const { return land_ctas_; }
  // The arena a cluster executor needs for a session with its own arena running `kinds` on
  // `rails` (the executor's: two-sided programs hold the lowering's counters too): the plan's
  // layout, its counters region holding every collective's range; for a TIDE-AG that pulls
  // (GroupPlacement::pull_landing; kinds = {all_gather} only) the pulled arena, its stage and
  // exactly its programs' counters ([Note: pulled arena] in tide/plan.h).
  static ArenaSpec own_arena(const Plan& plan, const std::vector<Collective>& kinds, Rails rails,
                             bool pull_landing = false);

  // The program set call `seq` of `kind` runs, built and cached on first use.
  std::shared_ptr<const ProgramSet> programs(Collective kind, int64_t seq, float alpha = 1.0f, bool accumulate = false);
  int64_t calls(Collective kind) const;  // calls issued so far (the last seq)

  // One call: the next seq of `kind`, its program set, the executor's run. Returns the seq.
  int64_t all_gather(const std::vector<RankBindingList>& buffers, const std::vector<uintptr_t>& streams = {});
  int64_t reduce_scatter(float alpha, bool accumulate, const std::vector<RankBindingList>& buffers,
                         const std::vector<uintptr_t>& streams = {}, bool expert_lane = false);

 private:
  using Key = std::tuple<int, int, float, bool>;  // kind, bank, alpha, accumulate
  std::shared_ptr<ProgramSet> build(Collective kind, int bank, float alpha, bool accumulate) const;
  void check_new(Collective kind, float alpha, bool accumulate);
  int64_t call(Collective kind, float alpha, bool accumulate, const std::vector<RankBindingList>& buffers,
               const std::vector<uintptr_t>& streams);

  std::shared_ptr<const Plan> plan_;
  std::shared_ptr<CallExecutor> executor_;
  GroupPlacement placement_;
  SessionOptions opt_;
  int sum_ctas_ = 0, land_ctas_ = 0;
  Rails rails_ = Rails::kOneSided;  // the executor's
  RegionTable regions_;            // copy of the executor's shared layout (when it has one)
  std::map<Key, std::shared_ptr<ProgramSet>> cache_;
  int64_t seq_[kNumCollectives] = {0, 0, 0};
  mutable std::mutex mu_;
};

// ---- CPU executors (runtime_cpu.cc) -----------------------------------------------------------
// The CPU virtual cluster: every rank's arena in this process (threads) or in forked processes
// over shared memory, run_cpu per call. Its arena is laid out by `spec` (a session's own_arena).
class CpuClusterCallExecutor final : public CallExecutor {
 public:
  CpuClusterCallExecutor(int world, const ArenaSpec& spec, bool processes, const ExecutorOptions& opt);
  int world() const override { return arena_.world(); }
  void run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
           const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) override;
  std::string name() const override { return "cpu-cluster"; }
  void set_timeout(double timeout_s) override;
  Rails rails() const override { return opt_.rails; }  // two-sided: a LocalRail per run
  CpuArena& arena() { return arena_; }
  CpuRunOptions& run_options() { return opt_; }  // fault injection (tests), verify_agreement

 private:
  void run_locked(std::vector<std::vector<Call>>& per_rank, std::vector<RankBindings>& b);
  CpuArena arena_;
  CpuRunOptions opt_;
  std::mutex mu_;
  // A call that failed after its ranks started (timeout, dead peer, interrupt, corruption)
  // leaves the arena's counters mid-call: every later call is refused at once with this.
  std::string failed_;
};

// One rank of a job whose ranks are processes, over every rank's shared-memory segment.
class CpuRankCallExecutor final : public CallExecutor {
 public:
  CpuRankCallExecutor(std::shared_ptr<RankExecutor> ex, RegionTable regions);
  int world() const override { return ex_->world(); }
  const RegionTable* regions() const override { return regions_.empty() ? nullptr : &regions_; }
  void run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
           const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) override;
  std::string name() const override { return "cpu-rank"; }
  void set_timeout(double timeout_s) override;
  Rails rails() const override { return ex_->rails(); }
  RankExecutor& rank_executor() { return *ex_; }

 private:
  std::shared_ptr<RankExecutor> ex_;
  RegionTable regions_;
};

}  // namespace tide
