// CUDA rank executor (contract in rank_executor.h).
#include "exec/cuda/rank_executor.h"

#include <algorithm>
#include <map>

#include "tide/errors.h"

namespace tide::cuda {

namespace {
// The entry fence's waits as the watchdog names them when overdue ([Note: watchdog and
// fail-stop]): a wait's label is the index of the peer in `peers`, its value the run number.
class FenceLabels final : public WaitLabels {
 public:
  FenceLabels(int rank, std::string group, std::vector<int> peers)
      : rank_(rank), group_(std::move(group)), peers_(std::move(peers)) {}
  std::string describe(const WaitSpec* specs, size_t n, int64_t seq) const override {
    std::string s;
    for (size_t i = 0; i < n; ++i) {
      const int g = specs[i].label >= 0 && static_cast<size_t>(specs[i].label) < peers_.size()
                        ? peers_[static_cast<size_t>(specs[i].label)] : -1;
      const uint64_t v = specs[i].value;
      s += TIDE_STR_CAT(i ? "; or " : "", "rank ", rank_, " entry fence before op 0 (waits for rank ", g, " ",
                        fence_words(v), "; counter fence@rank ", g, " >= ", v, ") seq ", seq, " group ", group_,
                        ": rank ", g, " is behind (still in an earlier collective, stalled or dead)");
    }
    return s;
  }

 private:
  int rank_;
  std::string group_;
  std::vector<int> peers_;
};
}  // namespace

struct CudaRankExecutor::Entry : CachedSet {
  std::vector<int> members;
  bool program_layout = false;
  int me = -1;                       // this rank's group rank
  std::shared_ptr<const ProgramIndex> index;
  std::unique_ptr<ProgramTables> tables;
  std::vector<int> writes;           // fabric ranks of its entry fence (ProgramUse::fence_peers)
  bool arrival = false;              // it lands in their ring slots: the fence waits for their start
  std::map<std::pair<int, int>, int64_t> needs;  // (user kind, index) -> bytes the program touches
  int64_t fence_index = -1;          // the executor's counter in region "counters"
  std::shared_ptr<const WaitLabels> fence_labels;  // the fence's waits, named when overdue
  SetGraphs graphs;                  // this set's captured calls
};

namespace {
CudaRunOptions run_options(const ExecutorOptions& opt) {
  CudaRunOptions o;
  static_cast<ExecutorOptions&>(o) = with_debug_env(opt);
  validate(o);
  return o;
}
}  // namespace

CudaRankExecutor::CudaRankExecutor(std::shared_ptr<fabric::Fabric> fabric, int rank, const Topology& topo,
                                   const RegionTable& regions, const ExecutorOptions& opt, bool fence)
    : fabric_(std::move(fabric)), rank_(rank), topo_(topo), opt_(run_options(opt)), fence_(fence), lanes_(opt_) {
  TIDE_PLAN_CHECK(fabric_ != nullptr, "CudaRankExecutor: no fabric");
  TIDE_PLAN_CHECK(!opt_.staging_canary, "ExecutorOptions.staging_canary: the CUDA rank executor (ranks in several "
                  "processes) has no staging canary (exec/cuda/staging_canary.h); the in-process executor has it");
  TIDE_PLAN_CHECK(topo.nodes >= 1 && topo.gpus_per_node >= 1 && topo.world() == fabric_->world(),
                  "CudaRankExecutor: a ", topo.nodes, "x", topo.gpus_per_node, " topology over a fabric of ",
                  fabric_->world(), " ranks");
  TIDE_PLAN_CHECK(rank >= 0 && rank < fabric_->world(), "CudaRankExecutor: rank ", rank, " is outside [0, ",
                  fabric_->world(), ")");
  TIDE_PLAN_CHECK(fabric_->is_local(rank) && fabric_->device_of(rank) >= 0, "CudaRankExecutor: rank ", rank,
                  "'s arena does not belong to this process's fabric");
  have_layout_ = !regions.empty();
  if (have_layout_) layout_ = arena_layout_from(regions, fabric_->arena_bytes(), "CudaRankExecutor");
  device_ = fabric_->device_of(rank);
  TIDE_CHECK_CUDA(cudaSetDevice(device_), "device ", device_);
  preload_kernels(device_);  // [Note: eager kernel loading]
  fs_ = std::make_unique<FailStopStreams>("CudaRankExecutor", std::vector<int>{device_}, opt_.timeout_s);
  for (cudaEvent_t* e : {&ev_caller_, &ev_entry_})
    TIDE_CHECK_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  if (opt_.graphs) graphs_ = std::make_unique<CallGraphs>(device_, opt_.timeout_s);
  // [Note: same-process issue gate]: joined here, before any rank of the process runs a call; the
  // fabric shares the board once its peers are open, which CudaProcessRank and the tests do before
  // making executors (one made before takes no turns). Replayed calls take no turns.
  if (opt_.issue_gate && !opt_.graphs && fabric_->issue_board()) {
    board_ = fabric_->issue_board();
    board_->join(rank_);
  }
}

CudaRankExecutor::~CudaRankExecutor() {
  if (board_) board_->leave(rank_);  // the process's other ranks no longer wait for this one
  cudaSetDevice(device_);
  fs_->quiesce();
  cache_.clear();
  graphs_.reset();
  for (cudaEvent_t e : {ev_caller_, ev_entry_})
    if (e) cudaEventDestroy(e);
}

void CudaRankExecutor::set_timeout(double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  opt_.timeout_s = fs_->set_timeout(timeout_s);  // validated
  if (graphs_) graphs_->set_timeout(opt_.timeout_s);  // captures from now on
}

CudaRankExecutor::Entry& CudaRankExecutor::prepare(const std::shared_ptr<const ProgramSet>& sp,
                                                   const std::vector<int>& members) {
  sp->require_built("CudaRankExecutor.run");
  const std::vector<Program>& progs = sp->progs;
  const bool program_layout = sp->arena_bound;
  // Stale: the set died, or was mutated in place (inject_fault) since it was prepared.
  cache_.drop_stale(*sp, [&] { fs_->sync_all(); });  // their run tables may still be read
  if (Entry* e = cache_.find(*sp, [&](const Entry& x) { return x.members == members && x.program_layout == program_layout; }))
    return *e;

  const int N = static_cast<int>(members.size());
  TIDE_PLAN_CHECK(static_cast<int>(progs.size()) == N, "CudaRankExecutor.run: a program set of ", progs.size(),
                  " programs for ", N, " ranks", N == world() ? " (pass ranks= for a sub-group's programs)" : "");
  TIDE_PLAN_CHECK(N <= kMaxSlots - kSlotArena0, "CudaRankExecutor: at most ", kMaxSlots - kSlotArena0, " ranks");
  auto e = std::make_unique<Entry>();
  e->bind(sp);
  e->members = members;
  e->program_layout = program_layout;
  e->index = sp->index();
  for (int i = 0; i < N; ++i) {
    TIDE_PLAN_CHECK(members[i] >= 0 && members[i] < world(), "CudaRankExecutor.run: ranks[", i, "] = ", members[i],
                    " is outside [0, ", world(), ")");
    TIDE_PLAN_CHECK(std::count(members.begin(), members.end(), members[i]) == 1, "CudaRankExecutor.run: rank ",
                    members[i], " appears twice in ranks");
    if (members[i] == rank_) e->me = i;
  }
  TIDE_PLAN_CHECK(e->me >= 0, "CudaRankExecutor.run: rank ", rank_, " is not in ranks");
  const Program& mine = progs[static_cast<size_t>(e->me)];
  const bool whole = N == world() && members == [&] {
    std::vector<int> v(static_cast<size_t>(N));
    for (int i = 0; i < N; ++i) v[static_cast<size_t>(i)] = i;
    return v;
  }();
  TIDE_PLAN_CHECK(!whole || (mine.topo.nodes == topo_.nodes && mine.topo.gpus_per_node == topo_.gpus_per_node),
                  "CudaRankExecutor.run: the program is for ", mine.topo.nodes, "x", mine.topo.gpus_per_node,
                  " ranks, this executor is ", topo_.nodes, "x", topo_.gpus_per_node);
  for (int i = 0; i < N; ++i) {
    const Program& p = progs[static_cast<size_t>(i)];
    TIDE_PLAN_CHECK(p.version == kProgramIrVersion, "rank ", members[i], ": program IR version ", p.version);
    TIDE_PLAN_CHECK(p.rank == i, "program at position ", i, " is rank ", p.rank, "'s program");
    TIDE_PLAN_CHECK(p.topo.world() == N, "CudaRankExecutor.run: the program is for ", p.topo.world(),
                    " ranks, ranks= names ", N);
    TIDE_PLAN_CHECK(p.plan_hash == progs[0].plan_hash && p.group == progs[0].group &&
                        p.collective == progs[0].collective,
                    "rank ", members[i], " runs plan ", p.plan_hash, " group ", p.group, " but rank ", members[0],
                    " runs plan ", progs[0].plan_hash, " group ", progs[0].group, " (inconsistent programs)");
  }
  // Layout: the caller's regions, or the set's own (built with arena=, or no regions given).
  ArenaSpec layout = have_layout_ && !program_layout ? layout_ : mine.arena;
  if (have_layout_ && program_layout)
    TIDE_PLAN_CHECK(layout.counters_offset == layout_.counters_offset && layout.counters_bytes == layout_.counters_bytes,
                    "CudaRankExecutor.run: the programs were bound to a 'counters' region [", layout.counters_offset,
                    ", +", layout.counters_bytes, ") other than this executor's [", layout_.counters_offset, ", +",
                    layout_.counters_bytes, ")");
  // What this rank's program touches (the set's index), admitted onto the layout.
  const ProgramIndex& index = *e->index;
  admit(progs, index, e->me, layout, "CudaRankExecutor", rank_, fabric_->arena_bytes(), fence_);
  if (fence_ && (layout.counters_offset < 0 || layout.counters_bytes < 8))
    throw Error(TIDE_STR_CAT("CudaRankExecutor: rank ", rank_, "'s program (group ", mine.group,
                             ") uses arena region 'counters', which the arena layout does not have"));
  e->needs = index.use[static_cast<size_t>(e->me)].user_end;
  for (int g : index.use[static_cast<size_t>(e->me)].fence_peers) e->writes.push_back(members[static_cast<size_t>(g)]);
  e->arrival = index.use[static_cast<size_t>(e->me)].lands_in_peers;
  if (fence_) {
    e->fence_index = layout.counters_bytes / 8 - 1;
    e->fence_labels = std::make_shared<FenceLabels>(rank_, TIDE_STR_CAT(mine.group), e->writes);
  }
  std::vector<char> local(static_cast<size_t>(N), 0);
  local[static_cast<size_t>(e->me)] = 1;
  TIDE_CHECK_CUDA(cudaSetDevice(device_));
  e->tables = make_program_tables(progs, index, members, std::move(local), layout, device_);
  return cache_.add(std::move(e));
}

void CudaRankExecutor::check_buffers(const Entry& e, const RankBindings& b) const {
  for (const auto& [ki, end] : e.needs) {
    const BufKind kind = static_cast<BufKind>(ki.first);
    const int index = ki.second;
    const UserBuffer* u = b.find(kind, index);
    const std::string what = TIDE_STR_CAT(buf_kind_name(kind), index >= 0 ? TIDE_STR_CAT("[", index, "]") : std::string());
    TIDE_PLAN_CHECK(u != nullptr, "CudaRankExecutor.run: rank ", rank_, "'s program needs ", what, " (", end,
                    " bytes); none is bound");
    TIDE_PLAN_CHECK(u->bytes >= end, "CudaRankExecutor.run: rank ", rank_, ": ", what, " has ", u->bytes,
                    " bytes, the program touches ", end);
  }
}

// [Note: entry fence] (exec/cpu/rank_executor.cc) on the GPU: stream 0 writes fence_started(k)
// into this rank's fence counter once the caller's prior work is done (fence_start), and waits
// until every peer of its fence shows fence_target(k): started run k where it lands in their ring
// slots, else finished run k - 1 (fence_wait). fence_finished(k) is written after every internal
// stream of run k joined (finish_run). Replays compute all three from the run number on the
// device ([Note: replayed calls]).
uint64_t* CudaRankExecutor::fence_ptr(const Entry& e, int g) const {
  char* arena = fabric_->arena(g);
  TIDE_CHECK(arena != nullptr, "rank ", g, "'s arena is not open in this process (open_peers first)");
  return reinterpret_cast<uint64_t*>(arena + e.tables->layout.counters_offset) + e.fence_index;
}

void CudaRankExecutor::fence_start(const Entry& e, GraphCapture* graph) {
  const cudaStream_t s0 = fs_->streams(0)[0];
  if (graph == nullptr)
    signal(s0, fence_ptr(e, rank_), fence_started(runs_));
  else
    launch_graph_raise(fence_ptr(e, rank_), GraphValue{-1, 2, true}, graph->params, s0);  // 2 run - 1
}

void CudaRankExecutor::fence_wait(const Entry& e, int64_t seq, const std::vector<Program>& progs, GraphCapture* graph) {
  const uint64_t k = runs_;
  const cudaStream_t s0 = fs_->streams(0)[0];
  const GraphValue target{e.arrival ? -1 : -2, 2, true};  // a replay's fence_target(run, arrival)
  std::vector<WaitSpec> waits;  // eager: one watched batch ([Note: watchdog and fail-stop])
  for (size_t i = 0; i < e.writes.size(); ++i) {
    const int g = e.writes[i];
    if (graph != nullptr) {
      const std::string what = TIDE_STR_CAT("rank ", rank_, " entry fence before op 0 (waits for rank ", g, " ",
                                            e.arrival ? "to start this run" : "to finish its previous run",
                                            "; counter fence@rank ", g, ") group ", progs[0].group,
                                            ": rank ", g, " is behind (still in an earlier collective, stalled or dead);");
      launch_graph_wait(fence_ptr(e, g), target, graph->params, graph->timeout_ns, graph->fault, graph->flags,
                        graph->add_wait(what), graph->graph_id, s0);
      continue;
    }
    const uint64_t v = fence_target(k, e.arrival);
    if (v > 0) waits.push_back(WaitSpec{fence_ptr(e, g), v, static_cast<int32_t>(i)});
  }
  if (!waits.empty()) fs_->watchdog().watched_waits(s0, device_, waits.data(), waits.size(), e.fence_labels, seq);
}

void CudaRankExecutor::finish_run(const Entry& e, cudaStream_t joined, GraphCapture* graph) {
  if (graph == nullptr)
    signal(joined, fence_ptr(e, rank_), fence_finished(runs_));
  else
    launch_graph_raise(fence_ptr(e, rank_), GraphValue{0, 2, true}, graph->params, joined);
}

// [Note: replayed calls serialise] A replay runs where an eager call runs: on stream 0, after the
// caller's prior work and after this executor's previous call (eager or replayed), and the caller
// waits for it. The entry fence tells a peer that run k finished by the value this rank's counter
// holds, and scratch shared by groups (stage slots, RS staging) is reused on the fence's word: both
// hold only while this rank's runs follow each other on the device. Launched on the caller's own
// stream instead, a replay of run k + 1 (an all-gather on FSDP2's all-gather stream) overlapped
// run k (a reduce-scatter on its reduce-scatter stream): fence_started(k + 1) overtook
// fence_finished(k), and a pulling peer read a stage slot being rewritten.
void CudaRankExecutor::replay(CallGraph& g, int64_t seq, cudaStream_t caller, bool advance) {
  const cudaStream_t s0 = fs_->streams(0)[0];
  TIDE_CHECK_CUDA(cudaEventRecord(ev_caller_, caller), "recording the caller stream");
  TIDE_CHECK_CUDA(cudaStreamWaitEvent(s0, ev_caller_, 0), "ordering a replay after the caller");
  ++runs_;
  graphs_->launch(g, *fabric_, seq, runs_, s0, advance);
  fs_->join_caller(0, 1, caller, true, TIDE_STR_CAT("rank ", rank_, " replayed call seq ", seq));
  CallGraphs* graphs = graphs_.get();  // the watchdog's late work ends before it (~Watchdog)
  std::weak_ptr<fabric::NcclRail> rail = rail_;  // never owned by the watchdog (issue.cc)
  const std::string late = TIDE_STR_CAT("rank ", rank_, " call seq ", seq, " (a replayed graph) did not complete: a "
                                        "peer is behind, stalled or dead; its waits are abandoned");
  fs_->watchdog().watched_work(s0, late, [graphs, rail, late] {
    graphs->abort();
    if (auto r = rail.lock()) r->abort(late);
  });
}

void CudaRankExecutor::capture(const Entry& e, GraphCapture& cap, IssueContext& c, int64_t seq,
                               const std::vector<Program>& progs) {
  const size_t ns = e.tables->stream_ops[static_cast<size_t>(e.me)].size();
  const std::vector<cudaStream_t>& own = fs_->streams(0);
  const cudaStream_t origin = graphs_->origin();
  TIDE_CHECK_CUDA(cudaEventRecord(ev_caller_, origin));
  TIDE_CHECK_CUDA(cudaStreamWaitEvent(own[0], ev_caller_, 0));
  if (fence_) {
    fence_start(e, &cap);
    fence_wait(e, seq, progs, &cap);
  }
  TIDE_CHECK_CUDA(cudaEventRecord(ev_entry_, own[0]));
  for (size_t s = 1; s < ns; ++s) TIDE_CHECK_CUDA(cudaStreamWaitEvent(own[s], ev_entry_, 0));
  c.graph = &cap;
  issue_call(c, seq);
  fs_->join_caller(0, ns, origin, true, TIDE_STR_CAT("rank ", rank_, " capturing call seq ", seq));
  if (fence_) finish_run(e, origin, &cap);  // origin is past every stream of the call
}

void CudaRankExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const RankBindings& buffers,
                           cudaStream_t caller, const std::vector<int>* ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  fs_->check_usable();
  TIDE_PLAN_CHECK(set != nullptr && !set->progs.empty(), "CudaRankExecutor.run: empty program set");
  const std::vector<Program>* progs = &set->progs;
  TIDE_PLAN_CHECK(seq >= 1, "CudaRankExecutor.run: seq must be >= 1, got ", seq);
  std::vector<int> members;
  if (ranks) {
    members = *ranks;
  } else {
    for (int r = 0; r < world(); ++r) members.push_back(r);
  }
  DeviceGuard device(device_);
  // Bad input stops here, before anything is enqueued (the executor stays usable).
  Entry& e = prepare(set, members);
  check_buffers(e, buffers);
  const Program& mine = set->progs[static_cast<size_t>(e.me)];
  TIDE_PLAN_CHECK(mine.rails == opt_.rails, "CudaRankExecutor.run: a ", rails_name(mine.rails), " program on an "
                  "executor with ", rails_name(opt_.rails), " rails (ExecutorOptions.rails)");
  TIDE_PLAN_CHECK(mine.rails == Rails::kOneSided || rail_ != nullptr, "CudaRankExecutor.run: rank ", rank_,
                  " runs a two-sided program but has no rail (set_rail)");
  const int L = topo_.gpus_per_node;
  for (int g : e.members)
    TIDE_PLAN_CHECK(fabric_->arena(g) != nullptr || (mine.rails == Rails::kTwoSided && g / L != rank_ / L),
                    "CudaRankExecutor.run: rank ", g, "'s arena is not open in this process (call open_peers first)");
  const size_t N = e.members.size();
  const size_t ns = e.tables->stream_ops[static_cast<size_t>(e.me)].size();
  fs_->ensure_streams(0, ns);
  const std::vector<cudaStream_t>& own = fs_->streams(0);

  if (fence_ && e.arrival && !e.writes.empty()) ++arrival_fences_;  // eager, captured or replayed
  // The issue context: built for an eager call or a capture only, never for a replay.
  std::vector<std::vector<cudaStream_t>> streams;
  std::vector<RankBindings> bufs;
  IssueContext c;
  auto context = [&]() -> IssueContext& {
    streams.assign(N, {});
    streams[static_cast<size_t>(e.me)].assign(own.begin(), own.begin() + static_cast<long>(ns));
    bufs.assign(N, RankBindings{});
    bufs[static_cast<size_t>(e.me)] = buffers;
    c.fabric = fabric_.get();
    c.programs = progs;
    c.tables = e.tables.get();
    c.opt = &opt_;
    c.watchdog = &fs_->watchdog();
    c.streams = &streams;
    c.buffers = &bufs;
    c.lanes = &lanes_;
    c.rail = rail_;
    c.rail_gpus_per_node = topo_.gpus_per_node;
    return c;
  };
  auto call = [&] { return TIDE_STR_CAT("rank ", rank_, " call seq ", seq); };
  if (graphs_ &&  // [Note: replayed calls]
      graphs_->run(e.graphs, bindings_key(buffers), *fs_,
                   [&](GraphCapture& cap) { capture(e, cap, context(), seq, *progs); },
                   [&](CallGraph& g, bool advance) { replay(g, seq, caller, advance); })) {
    if (opt_.sync_every_call) fs_->guarded([&] {
        fs_->drain_and_sync(call());
        graphs_->check(*fs_);
      });
    return;
  }
  context();
  try {
    // [Note: same-process issue gate]: the entry of every rank of this process, then their fence
    // waits, then the walk's steps, each in its turn.
    const std::unique_ptr<fabric::IssueTurns> t = turns(e, seq);
    auto each = [&](auto&& mine) {
      if (!t) return mine();
      for (int r : t->ranks()) {
        if (r != rank_) {
          t->peer(r, [] {});
          continue;
        }
        t->own();
        mine();
      }
    };
    each([&] {
      TIDE_CHECK_CUDA(cudaEventRecord(ev_caller_, caller), "recording the caller stream");
      TIDE_CHECK_CUDA(cudaStreamWaitEvent(own[0], ev_caller_, 0));
      ++runs_;
      if (fence_) fence_start(e);
    });
    each([&] {
      if (fence_) fence_wait(e, seq, *progs);
      TIDE_CHECK_CUDA(cudaEventRecord(ev_entry_, own[0]));
      for (size_t s = 1; s < ns; ++s) TIDE_CHECK_CUDA(cudaStreamWaitEvent(own[s], ev_entry_, 0));
    });
    c.turns = t.get();
    issue_call(c, seq);
  } catch (const std::exception& ex) {
    fs_->fail(ex.what());
    fs_->join_caller(0, ns, caller, false, call());  // the caller's stream stays ordered after what was enqueued
    throw;
  }
  fs_->guarded([&] {
    fs_->join_caller(0, ns, caller, true, call());
    if (fence_) finish_run(e, own[0], nullptr);  // stream 0 joined every stream of the call
    if (opt_.sync_every_call) fs_->drain_and_sync(call());  // debug: every call completes (or names its stuck wait)
  });
}

std::unique_ptr<fabric::IssueTurns> CudaRankExecutor::turns(const Entry& e, int64_t seq) {
  if (!board_) return nullptr;
  std::vector<int> here = board_->joined_among(e.members);
  if (here.size() < 2) return nullptr;  // no other rank of this process in this call
  return std::make_unique<fabric::IssueTurns>(*board_, std::move(here), rank_, opt_.timeout_s,
                                              TIDE_STR_CAT("rank ", rank_, " call seq ", seq));
}

void CudaRankExecutor::set_rail(std::shared_ptr<fabric::NcclRail> rail) {
  std::lock_guard<std::mutex> lock(mu_);
  TIDE_PLAN_CHECK(rail == nullptr || (rail->rank() == rank_ / topo_.gpus_per_node && rail->size() == topo_.nodes),
                  "CudaRankExecutor.set_rail: rank ", rank_, " of ", topo_.nodes, "x", topo_.gpus_per_node,
                  " needs rail rank ", rank_ / topo_.gpus_per_node, " of ", topo_.nodes, ", got ",
                  rail ? rail->rank() : -1, " of ", rail ? rail->size() : -1);
  rail_ = std::move(rail);
}

void CudaRankExecutor::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard device(device_);
  fs_->synchronize(TIDE_STR_CAT("rank ", rank_, " executor stream"));
  if (graphs_) graphs_->check(*fs_);
}

}  // namespace tide::cuda
