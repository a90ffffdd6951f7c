// The CUDA in-process executor (contract in executor.h; the issue path in issue.cc).
#include "exec/cuda/executor.h"

#include <algorithm>

#include "tide/errors.h"

namespace tide::cuda {

void launch_stall(double seconds, cudaStream_t stream);  // kernels.cu (fault injection only)

struct CudaExecutor::Entry : CachedSet {
  std::unique_ptr<ProgramTables> tables;
  std::unique_ptr<CanaryPlan> canary;  // ExecutorOptions::staging_canary
  SetGraphs graphs;                    // this set's captured calls
};

namespace {
std::vector<int> devices_of(const fabric::Fabric& f) {
  std::vector<int> d;
  for (int r = 0; r < f.world(); ++r) d.push_back(f.device_of(r));
  return d;
}
}  // namespace

CudaExecutor::CudaExecutor(std::shared_ptr<fabric::Fabric> fabric, const ExecutorOptions& opt)
    : fabric_(std::move(fabric)), lanes_(opt) {
  TIDE_PLAN_CHECK(fabric_ != nullptr, "CudaExecutor: no fabric");
  static_cast<ExecutorOptions&>(opt_) = with_debug_env(opt);
  validate(opt_);
  lanes_ = CopyLaneTable(opt_);
  const int n = fabric_->world();
  TIDE_PLAN_CHECK(n <= kMaxSlots - kSlotArena0, "CudaExecutor: at most ", kMaxSlots - kSlotArena0, " ranks");
  for (int r = 0; r < n; ++r) {
    TIDE_PLAN_CHECK(fabric_->is_local(r), "CudaExecutor: rank ", r, " is not in this process (use CudaRankExecutor)");
    preload_kernels(fabric_->device_of(r));  // [Note: eager kernel loading]
  }
  fs_ = std::make_unique<FailStopStreams>("CudaExecutor", devices_of(*fabric_), opt_.timeout_s);
  if (opt_.staging_canary) {
    DeviceGuard guard(fabric_->device_of(0), "CudaExecutor: ");
    canary_ = std::make_unique<StagingCanary>(n);
  }
  for (int r = 0; r < n; ++r) {
    DeviceGuard guard(fabric_->device_of(r), "CudaExecutor: ");
    cudaEvent_t e = nullptr;
    TIDE_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "rank ", r, " handoff event");
    ready_.push_back(e);
  }
  const std::vector<int> devices = devices_of(*fabric_);
  const bool one_device = std::all_of(devices.begin(), devices.end(), [&](int d) { return d == devices[0]; });
  if (opt_.graphs && one_device && !canary_) {
    DeviceGuard guard(devices[0], "CudaExecutor: ");
    graphs_ = std::make_unique<CallGraphs>(devices[0], opt_.timeout_s);
    for (cudaEvent_t* e : {&fork_, &done_}) TIDE_CHECK_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
}

CudaExecutor::~CudaExecutor() {
  fs_->quiesce();
  cache_.clear();
  graphs_.reset();
  for (cudaEvent_t e : {fork_, done_})
    if (e) cudaEventDestroy(e);
  for (size_t r = 0; r < ready_.size(); ++r) {
    cudaSetDevice(fabric_->device_of(static_cast<int>(r)));
    cudaEventDestroy(ready_[r]);
  }
}

CudaExecutor::Entry& CudaExecutor::prepare(const std::shared_ptr<const ProgramSet>& sp) {
  TIDE_PLAN_CHECK(sp != nullptr && !sp->progs.empty(), "CudaExecutor.run: empty program set");
  sp->require_built("CudaExecutor.run");
  cache_.drop_stale(*sp, [&] { fs_->sync_all(); });  // their run tables may still be read
  if (Entry* e = cache_.find(*sp, [](const Entry&) { return true; })) return *e;

  const std::vector<Program>& programs = sp->progs;
  const int n = fabric_->world();
  TIDE_PLAN_CHECK(static_cast<int>(programs.size()) == n, "CudaExecutor: ", programs.size(),
                  " programs for a fabric of ", n, " ranks");
  const Program& p0 = programs[0];
  for (int r = 0; r < n; ++r) {
    const Program& p = programs[static_cast<size_t>(r)];
    TIDE_PLAN_CHECK(p.version == kProgramIrVersion, "rank ", r, ": program IR version ", p.version);
    TIDE_PLAN_CHECK(p.rank == r, "program ", r, " is rank ", p.rank, "'s program");
    // All ranks must run the same plan and group, or the collective order is broken (I4).
    TIDE_PLAN_CHECK(p.plan_hash == p0.plan_hash && p.group == p0.group && p.collective == p0.collective,
                    "rank ", r, " runs plan ", p.plan_hash, " group ", p.group, " but rank 0 runs plan ",
                    p0.plan_hash, " group ", p0.group, " (inconsistent programs)");
    for (int k = 0; k < kNumBufKinds; ++k)
      TIDE_PLAN_CHECK(p.arena.offset[k] == p0.arena.offset[k], "arena layouts differ on rank ", r);
  }
  const std::shared_ptr<const ProgramIndex> index = sp->index();
  for (int r = 0; r < n; ++r) admit(programs, *index, r, p0.arena, "CudaExecutor", r, fabric_->arena_bytes(), false);
  auto e = std::make_unique<Entry>();
  e->bind(sp);
  std::vector<int> members(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    members[static_cast<size_t>(r)] = r;
    fs_->ensure_streams(static_cast<size_t>(r), std::max<size_t>(1, programs[static_cast<size_t>(r)].streams.size()));
    fabric_->issued(r, static_cast<size_t>(programs[static_cast<size_t>(r)].num_counters));
  }
  DeviceGuard guard(fabric_->device_of(0), "CudaExecutor: ");
  e->tables = make_program_tables(programs, *index, members, std::vector<char>(static_cast<size_t>(n), 1), p0.arena,
                                  fabric_->device_of(0));
  if (canary_) e->canary = canary_->plan(programs);
  return cache_.add(std::move(e));
}

cudaStream_t CudaExecutor::stream(int rank, int s) const {
  return fs_->all_streams().at(static_cast<size_t>(rank)).at(static_cast<size_t>(s));
}

uint64_t* CudaExecutor::counter_ptr(const ProgramSet& set, int rank, int index) const {
  const Program& p = set.progs.at(static_cast<size_t>(rank));
  TIDE_CHECK(index >= 0 && index < p.num_counters, "counter ", index, " of rank ", rank);
  return reinterpret_cast<uint64_t*>(fabric_->arena(rank) + p.arena.counters_offset) + index;
}

void CudaExecutor::set_timeout(double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  opt_.timeout_s = fs_->set_timeout(timeout_s);  // validated
  if (graphs_) graphs_->set_timeout(opt_.timeout_s);  // captures from now on
}

void CudaExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq,
                       const std::vector<RankBindings>& buffers, const std::vector<cudaStream_t>& caller) {
  std::lock_guard<std::mutex> lock(mu_);
  fs_->check_usable();
  const int n = fabric_->world();
  TIDE_PLAN_CHECK(seq >= 1, "CudaExecutor.run: seq must be >= 1, got ", seq);
  TIDE_PLAN_CHECK(static_cast<int>(buffers.size()) == n, "CudaExecutor.run: ", buffers.size(),
                  " buffer sets for ", n, " ranks");
  TIDE_PLAN_CHECK(caller.empty() || static_cast<int>(caller.size()) == n, "CudaExecutor.run: ", caller.size(),
                  " caller streams for ", n, " ranks");
  DeviceGuard guard(fabric_->device_of(0), "CudaExecutor: ");
  Entry& e = prepare(set);  // bad input stops here, before anything is enqueued
  const std::vector<Program>& programs = set->progs;
  auto ns = [&](int r) { return std::max<size_t>(1, programs[static_cast<size_t>(r)].streams.size()); };
  auto streams = [&](int r) -> const std::vector<cudaStream_t>& { return fs_->streams(static_cast<size_t>(r)); };
  IssueContext c;
  c.fabric = fabric_.get();
  c.programs = &programs;
  c.tables = e.tables.get();
  c.opt = &opt_;
  c.watchdog = &fs_->watchdog();
  c.streams = &fs_->all_streams();
  c.buffers = &buffers;
  c.lanes = &lanes_;
  c.dead_rank = opt_.dead_rank;
  if (canary_) {
    c.canary = canary_.get();
    c.canary_plan = e.canary.get();
    c.canary_call = canary_->begin_call(seq);
  }
  // [Note: replayed calls]: a replay's handoff is its launch's; fault injection stays eager.
  if (graphs_ != nullptr && !caller.empty() && opt_.dead_rank < 0 && opt_.stall_rank < 0 &&
      graphs_->run(e.graphs, bindings_key(buffers), *fs_, [&](GraphCapture& cap) { capture(cap, c, seq); },
                   [&](CallGraph& g, bool advance) { launch(g, seq, caller, advance); })) {
    if (opt_.sync_every_call) fs_->guarded([&] {
        fs_->drain_and_sync("executor stream");
        graphs_->check(*fs_);
      });
    return;
  }
  // [Note: stream handoff] in: nothing of call `seq` before each caller stream got here.
  for (int r = 0; r < n && !caller.empty(); ++r) {
    TIDE_CHECK_CUDA(cudaSetDevice(fabric_->device_of(r)));
    TIDE_CHECK_CUDA(cudaEventRecord(ready_[static_cast<size_t>(r)], caller[static_cast<size_t>(r)]),
                    "rank ", r, ": recording the caller stream");
    for (size_t s = 0; s < ns(r); ++s) {
      TIDE_CHECK_CUDA(cudaStreamWaitEvent(streams(r)[s], ready_[static_cast<size_t>(r)], 0), "rank ", r, " stream ", s);
      if (after_replay_)  // [Note: replayed calls serialise]
        TIDE_CHECK_CUDA(cudaStreamWaitEvent(streams(r)[s], done_, 0), "rank ", r, " stream ", s, " after a replay");
    }
  }
  after_replay_ = false;
  if (opt_.stall_rank >= 0 && opt_.stall_rank < n && opt_.stall_s > 0)
    for (auto st : streams(opt_.stall_rank)) launch_stall(opt_.stall_s, st);
  fs_->guarded([&] {
    issue_call(c, seq);
    // Out: every internal stream joins stream 0, the caller stream waits for stream 0.
    for (int r = 0; r < n && !caller.empty(); ++r)
      fs_->join_caller(static_cast<size_t>(r), ns(r), caller[static_cast<size_t>(r)], true, TIDE_STR_CAT("rank ", r));
  });
  if (opt_.sync_every_call) {
    fs_->drain_and_sync("executor stream");
    check_canary();
  }
}

void CudaExecutor::capture(GraphCapture& cap, IssueContext& c, int64_t seq) {
  const int n = fabric_->world();
  const std::vector<Program>& programs = *c.programs;
  auto ns = [&](int r) { return std::max<size_t>(1, programs[static_cast<size_t>(r)].streams.size()); };
  const cudaStream_t origin = graphs_->origin();
  TIDE_CHECK_CUDA(cudaEventRecord(fork_, origin));
  for (int r = 0; r < n; ++r)
    for (size_t s = 0; s < ns(r); ++s) TIDE_CHECK_CUDA(cudaStreamWaitEvent(fs_->streams(static_cast<size_t>(r))[s], fork_, 0));
  c.graph = &cap;
  issue_call(c, seq);
  for (int r = 0; r < n; ++r)
    fs_->join_caller(static_cast<size_t>(r), ns(r), origin, true, TIDE_STR_CAT("rank ", r, " capturing call seq ", seq));
}

// [Note: replayed calls serialise] (rank_executor.cc) in one process: a replay is launched on
// rank 0's stream 0 after every caller's prior work and every rank's previous call (joined into
// its stream 0), and the next eager call's streams wait for it (after_replay_), so that calls
// follow each other on the internal streams as the contract says, replayed or not.
void CudaExecutor::launch(CallGraph& g, int64_t seq, const std::vector<cudaStream_t>& caller, bool advance) {
  const cudaStream_t s0 = fs_->streams(0)[0];
  for (size_t r = 0; r < caller.size(); ++r) {  // the callers' prior work, every rank's previous call
    TIDE_CHECK_CUDA(cudaEventRecord(ready_[r], caller[r]), "rank ", r, ": recording the caller stream");
    TIDE_CHECK_CUDA(cudaStreamWaitEvent(s0, ready_[r], 0), "rank ", r, ": joining the caller streams");
    if (r == 0) continue;
    TIDE_CHECK_CUDA(cudaEventRecord(ready_[r], fs_->streams(r)[0]), "rank ", r, ": recording its previous call");
    TIDE_CHECK_CUDA(cudaStreamWaitEvent(s0, ready_[r], 0), "rank ", r, ": ordering a replay after its previous call");
  }
  graphs_->launch(g, *fabric_, seq, 0, s0, advance);
  TIDE_CHECK_CUDA(cudaEventRecord(done_, s0), "recording a replayed call");
  for (size_t r = 0; r < caller.size(); ++r)
    TIDE_CHECK_CUDA(cudaStreamWaitEvent(caller[r], done_, 0), "rank ", r, ": waiting for the call");
  after_replay_ = true;
  CallGraphs* graphs = graphs_.get();
  const std::string late = TIDE_STR_CAT("CudaExecutor call seq ", seq, " (a replayed graph) did not complete within ",
                                        opt_.timeout_s, " s; its waits are abandoned");
  fs_->watchdog().watched_work(s0, late, [graphs] { graphs->abort(); });
}

void CudaExecutor::check_canary() {
  if (!canary_) return;
  const std::string why = canary_->fault();
  if (why.empty()) return;
  fs_->fail(why);
  throw Error(why);
}

void CudaExecutor::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  fs_->synchronize("executor stream");
  check_canary();
  if (graphs_) graphs_->check(*fs_);
}

}  // namespace tide::cuda
