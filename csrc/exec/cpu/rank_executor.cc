// RankExecutor: one rank's programs over every rank's separately mapped arena segment (ranks as
// the caller's processes, e.g. torch.distributed workers), and program binding to a caller's
// arena layout. The op interpreter is run_cpu's (step_ranks in interpreter.cc).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "exec/cpu/internal.h"
#include "tide/exec_cpu.h"
#include "tide/program_index.h"

namespace tide {

namespace {

// Region name -> BufKind (arena kinds only); -1 for names that are not a kind ("fixed", ...).
int kind_of(const std::string& name) {
  for (int k = 4; k < kNumBufKinds; ++k)
    if (name == buf_kind_name(static_cast<BufKind>(k))) return k;
  return -1;
}

ExecutorOptions checked(ExecutorOptions o) {
  validate(o);
  return o;
}

std::string region_names(const RegionTable& regions) {
  std::string s;
  for (const auto& kv : regions) s += (s.empty() ? "" : ", ") + kv.first;
  return s.empty() ? "none" : s;
}

}  // namespace

ArenaSpec arena_layout_from(const RegionTable& regions, int64_t limit, const char* who) {
  ArenaSpec a;
  for (int k = 0; k < kNumBufKinds; ++k) { a.offset[k] = -1; a.bytes[k] = 0; }
  a.counters_offset = -1;
  for (const auto& kv : regions) {
    const int64_t off = kv.second.first, bytes = kv.second.second;
    TIDE_PLAN_CHECK(off >= 0 && bytes >= 0 && (limit < 0 || off + bytes <= limit), who, ": region '", kv.first,
                    "' [", off, ", ", off + bytes, ") does not fit the ", limit, "-byte arena segment");
    a.total = std::max(a.total, off + bytes);
    if (kv.first == "counters") {
      TIDE_PLAN_CHECK(off % 8 == 0, who, ": region 'counters' at offset ", off, " is not 8-byte aligned");
      a.counters_offset = off;
      a.counters_bytes = bytes;
      continue;
    }
    const int k = kind_of(kv.first);
    if (k >= 0) { a.offset[k] = off; a.bytes[k] = bytes; }
  }
  return a;
}

RankExecutor::RankExecutor(int rank, const Topology& topo, const std::vector<std::string>& segment_names,
                           int64_t segment_bytes, const RegionTable& regions, const ExecutorOptions& opt,
                           bool fence)
    : rank_(rank), topo_(topo), segment_bytes_(segment_bytes), opt_(checked(with_debug_env(opt))), fence_(fence) {
  TIDE_PLAN_CHECK(static_cast<int>(segment_names.size()) == topo.world(), "RankExecutor: ",
                  segment_names.size(), " segments for ", topo.world(), " ranks (", topo.nodes, "x",
                  topo.gpus_per_node, ")");
  TIDE_PLAN_CHECK(segment_bytes > 0, "RankExecutor: segment_bytes must be positive, got ", segment_bytes);
  for (const auto& name : segment_names) {
    if (name.empty()) {  // host isolation: another node's arena is not mapped here
      TIDE_PLAN_CHECK(static_cast<int>(bases_.size()) != rank, "RankExecutor: rank ", rank, "'s own segment name is empty");
      bases_.push_back(nullptr);
      owned_.push_back(false);
      continue;
    }
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      const int err = errno;
      const size_t r = bases_.size();
      unmap_all();
      throw Error(TIDE_STR_CAT("RankExecutor: rank ", rank, " cannot open rank ", r,
                               "'s arena segment '", name, "': ", std::strerror(err)));
    }
    struct stat st {};
    const bool small = fstat(fd, &st) == 0 && st.st_size < segment_bytes;
    void* p = small ? MAP_FAILED
                    : mmap(nullptr, static_cast<size_t>(segment_bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (p == MAP_FAILED) {
      const size_t r = bases_.size();
      unmap_all();
      if (small)
        throw Error(TIDE_STR_CAT("RankExecutor: rank ", r, "'s arena segment '", name, "' has ",
                                 static_cast<int64_t>(st.st_size), " bytes, fewer than segment_bytes = ",
                                 segment_bytes));
      throw Error(TIDE_STR_CAT("RankExecutor: mapping rank ", r, "'s arena segment '", name, "' failed: ",
                               std::strerror(err)));
    }
    bases_.push_back(static_cast<uint8_t*>(p));
    owned_.push_back(true);
  }
  init(regions);
}

RankExecutor::RankExecutor(int rank, const Topology& topo, const std::vector<uint8_t*>& segment_bases,
                           int64_t segment_bytes, const RegionTable& regions, const ExecutorOptions& opt,
                           bool fence)
    : rank_(rank), topo_(topo), segment_bytes_(segment_bytes), opt_(checked(with_debug_env(opt))), fence_(fence) {
  TIDE_PLAN_CHECK(static_cast<int>(segment_bases.size()) == topo.world(), "RankExecutor: ",
                  segment_bases.size(), " segments for ", topo.world(), " ranks");
  for (uint8_t* b : segment_bases) {
    TIDE_PLAN_CHECK(b != nullptr || static_cast<int>(bases_.size()) != rank, "RankExecutor: rank ", rank,
                    "'s own segment address is null");
    bases_.push_back(b);
    owned_.push_back(false);
  }
  init(regions);
}

void RankExecutor::init(const RegionTable& regions) {
  TIDE_PLAN_CHECK(rank_ >= 0 && rank_ < world(), "RankExecutor: rank ", rank_, " is outside [0, ", world(), ")");
  layout_ = arena_layout_from(regions, segment_bytes_, "RankExecutor");
  shared_mem_.assign(CpuArena::Shared::bytes(world()) + 64, 0);
}

RankExecutor::~RankExecutor() { unmap_all(); }

void RankExecutor::set_timeout(double timeout_s) {
  const double t = checked_timeout(timeout_s);
  std::lock_guard<std::mutex> lock(mu_);
  opt_.timeout_s = t;
}

void RankExecutor::set_rail(std::shared_ptr<Rail> rail) {
  std::lock_guard<std::mutex> lock(mu_);
  rail_ = std::move(rail);
}

void RankExecutor::unmap_all() {
  for (size_t i = 0; i < bases_.size(); ++i)
    if (owned_[i] && bases_[i]) munmap(bases_[i], static_cast<size_t>(segment_bytes_));
  bases_.clear();
  owned_.clear();
}

void RankExecutor::run(const ProgramSet& set, int64_t seq, const RankBindings& bindings,
                       const std::vector<int>* ranks) {
  set.require_built("RankExecutor.run");
  const std::vector<Program>& progs = set.progs;
  const bool use_program_layout = set.arena_bound;
  // The program set's ranks: every rank of the executor, or a sub-group (HSDP shard group) whose
  // group rank i is global rank (*ranks)[i]. Programs number ranks within their group.
  std::vector<int> members;
  if (ranks) {
    members = *ranks;
  } else {
    for (int r = 0; r < world(); ++r) members.push_back(r);
  }
  const int N = static_cast<int>(members.size());
  TIDE_PLAN_CHECK(static_cast<int>(progs.size()) == N, "RankExecutor.run: a program set of ", progs.size(),
                  " programs for ", N, " ranks", ranks ? "" : " (pass ranks= for a sub-group's programs)");
  TIDE_PLAN_CHECK(seq >= 1, "RankExecutor.run: seq must be >= 1, got ", seq);
  int me = -1;
  for (int i = 0; i < N; ++i) {
    TIDE_PLAN_CHECK(members[i] >= 0 && members[i] < world(), "RankExecutor.run: ranks[", i, "] = ", members[i],
                    " is outside [0, ", world(), ")");
    if (members[i] == rank_) me = i;
  }
  TIDE_PLAN_CHECK(me >= 0, "RankExecutor.run: rank ", rank_, " is not in ranks");
  const Program& mine = progs[static_cast<size_t>(me)];
  TIDE_CHECK(mine.rank == me, "program for rank ", mine.rank, " at position ", me);
  TIDE_PLAN_CHECK(ranks || (mine.topo.nodes == topo_.nodes && mine.topo.gpus_per_node == topo_.gpus_per_node),
                  "RankExecutor.run: the program is for ", mine.topo.nodes, "x", mine.topo.gpus_per_node,
                  " ranks, this executor is ", topo_.nodes, "x", topo_.gpus_per_node);
  TIDE_PLAN_CHECK(mine.topo.world() == N, "RankExecutor.run: the program is for ", mine.topo.world(),
                  " ranks, ranks= names ", N);

  TIDE_PLAN_CHECK(mine.rails == opt_.rails, "RankExecutor.run: a ", rails_name(mine.rails), " program on an executor "
                  "with ", rails_name(opt_.rails), " rails (ExecutorOptions.rails)");
  std::lock_guard<std::mutex> lock(mu_);  // one run at a time (the run-wide state is per executor)
  TIDE_PLAN_CHECK(mine.rails == Rails::kOneSided || rail_ != nullptr, "RankExecutor.run: rank ", rank_,
                  " runs a two-sided program but has no rail transport (set_rail)");
  ArenaView view;
  view.nranks = N;
  for (int g : members) view.base.push_back(bases_[static_cast<size_t>(g)]);
  view.spec = use_program_layout ? mine.arena : layout_;
  if (use_program_layout)
    TIDE_PLAN_CHECK(view.spec.counters_offset == layout_.counters_offset &&
                        view.spec.counters_bytes == layout_.counters_bytes,
                    "RankExecutor.run: the programs were bound to a 'counters' region [", view.spec.counters_offset,
                    ", +", view.spec.counters_bytes, ") other than this executor's [", layout_.counters_offset, ", +",
                    layout_.counters_bytes, ")");
  // Regions the program touches must exist and fit the segment; counters likewise.
  const std::shared_ptr<const ProgramIndex> index = set.index();
  admit(progs, *index, me, view.spec, "RankExecutor", rank_, segment_bytes_, fence_);
  // Every run bumps the fence (run numbers must agree across ranks), even one writing no peer.
  const bool fenced = fence_ && view.spec.counters_offset >= 0 && view.num_counters() > 0;
  const uint64_t run = fenced ? entry_fence(view, mine, seq, index->use[static_cast<size_t>(me)], members) : 0;
  // Run-wide state is this process's own: peers' failures surface here as timeouts.
  void* mem = shared_mem_.data();
  const uintptr_t a = (reinterpret_cast<uintptr_t>(mem) + 63) / 64 * 64;
  view.sh = init_shared(reinterpret_cast<void*>(a), N);

  std::vector<std::vector<Call>> per_rank(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) per_rank[static_cast<size_t>(r)].push_back({&progs[static_cast<size_t>(r)], seq});
  std::vector<RankBindings> b(static_cast<size_t>(N));
  b[static_cast<size_t>(me)] = bindings;
  CpuRunOptions opt;
  static_cast<ExecutorOptions&>(opt) = opt_;
  opt.verify_agreement = false;
  opt.peers_remote = true;
  opt.fence_run = run;
  opt.rail = rail_.get();
  opt.rail_ranks = &members;
  opt.interrupted = interrupted_;
  step_ranks(view, per_rank, b, opt, me, me + 1);  // polls opt.interrupted while it waits
  rethrow_shared(view.sh);
  if (fenced) view.counters(mine.rank)[view.num_counters() - 1].store(fence_finished(run), std::memory_order_release);
}

// [Note: entry fence] Collectives of different groups share scratch regions (stage, RS staging /
// outbox / inbox / spare) whose reuse credits are per group, so a rank that has finished
// collective k must not push collective k+1 into a peer that is still consuming collective k.
// TIDE-AG's pushes also land in the peers' ring slots, which a peer's caller frees on its own
// stream (the slot's previous owner resharded there), so they must not arrive before the peer's
// caller has reached the same collective. Every run k publishes fence_started(k) in the last
// counter of this rank's counters region when it starts and fence_finished(k) when its ops are
// done; before its first op it waits, for every peer it writes into or that reads its arena
// (ProgramUse::fence_peers: a pulling peer), until the peer has started run k where it lands in
// the peer's ring (ProgramUse::lands_in_peers), else until the peer has finished run k - 1. So a TIDE-RS push never waits for a peer's compute to reach the call, only
// for its previous call's scratch: one handshake per call (the data) instead of two. All ranks
// issue the same collective sequence, so run numbers agree.
std::string fence_words(uint64_t value) {
  return value % 2 ? TIDE_STR_CAT("to start run #", (value + 1) / 2) : TIDE_STR_CAT("to finish run #", value / 2);
}

std::string fence_reached(uint64_t value) {
  if (value == 0) return "it has started no run";
  return value % 2 ? TIDE_STR_CAT("it has started run #", (value + 1) / 2, " and not finished it")
                   : TIDE_STR_CAT("it has finished run #", value / 2);
}

uint64_t RankExecutor::entry_fence(const ArenaView& view, const Program& mine, int64_t seq, const ProgramUse& use,
                                   const std::vector<int>& members) {
  const int64_t idx = view.num_counters() - 1;
  auto& own = view.counters(mine.rank)[idx];
  const uint64_t k = (own.load(std::memory_order_relaxed) + 1) / 2 + 1;  // after run k-1 finished or failed
  own.store(fence_started(k), std::memory_order_release);
  const uint64_t target = fence_target(k, use.lands_in_peers);
  if (use.lands_in_peers && !use.fence_peers.empty()) ++arrival_fences_;
  const auto start = std::chrono::steady_clock::now();
  int idle = 0;
  for (int p : use.fence_peers) {
    auto& c = view.counters(p)[idx];
    while (c.load(std::memory_order_acquire) < target) {
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > opt_.timeout_s)
        throw TimeoutError(TIDE_STR_CAT(
            "TIDE timeout after ", opt_.timeout_s, " s: rank ", rank_, " (node ", topo_.node_of(rank_), ", local ",
            topo_.local_of(rank_), ") call seq ", seq, " group ", mine.group,
            ": entry fence (before op 0) waits for rank ", members[static_cast<size_t>(p)], " ", fence_words(target),
            " (", fence_reached(c.load()), "): rank ", members[static_cast<size_t>(p)],
            " is behind (still in an earlier collective, stalled or dead)"));
      if (++idle < 64) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(idle < 1024 ? 20 : 200));
      if (interrupted_ && idle % 100 == 99 && interrupted_())
        throw Interrupted(TIDE_STR_CAT("interrupted: rank ", rank_, " call seq ", seq, " was stopped in its entry "
                                       "fence, waiting for rank ", members[static_cast<size_t>(p)]));
    }
  }
  return k;
}

void bind_programs_to_arena(std::vector<Program>& progs, const ArenaBindOptions& opt) {
  const int64_t base = opt.counter_base;
  TIDE_PLAN_CHECK(base >= 0, "counter_base must be >= 0, got ", base);
  TIDE_PLAN_CHECK(opt.regions || (opt.landing_region.empty() && opt.landing_offset == 0 && opt.resident_offset == 0),
                  "landing_region / landing_offset / resident_offset need arena= (the caller's region layout)");
  ArenaSpec layout;
  if (opt.regions) {
    layout = arena_layout_from(*opt.regions, -1, "arena");
    auto shift = [&](int k, const std::string& region, int64_t extra, const char* what) {
      auto it = opt.regions->find(region);
      TIDE_PLAN_CHECK(it != opt.regions->end(), what, ": region '", region, "' is not in arena (",
                      region_names(*opt.regions), ")");
      TIDE_PLAN_CHECK(extra >= 0 && extra <= it->second.second, what, ": offset ", extra,
                      " is outside region '", region, "' (", it->second.second, " bytes)");
      layout.offset[k] = it->second.first + extra;
      layout.bytes[k] = it->second.second - extra;
    };
    if (opt.landing_kind >= 0 && (!opt.landing_region.empty() || opt.landing_offset != 0))
      shift(opt.landing_kind, opt.landing_region.empty() ? buf_kind_name(static_cast<BufKind>(opt.landing_kind))
                                                         : opt.landing_region,
            opt.landing_offset, "landing_region");
    if (opt.resident_offset != 0)
      shift(static_cast<int>(BufKind::kResident), "resident", opt.resident_offset, "resident_offset");
  }
  for (Program& pr : progs) {
    if (opt.regions) pr.arena = layout;
    if (base == 0) continue;
    for (Op& op : pr.ops)
      if (op.counter.index >= 0) op.counter.index += static_cast<int32_t>(base);
    if (pr.release_event >= 0) pr.release_event += static_cast<int>(base);
    if (pr.done_event >= 0) pr.done_event += static_cast<int>(base);
    pr.counter_names.insert(pr.counter_names.begin(), static_cast<size_t>(base), std::string());
    pr.num_counters += static_cast<int>(base);
    if (!opt.regions) {
      // The programs' own layout: grow the counters region when it ends the arena.
      ArenaSpec& a = pr.arena;
      const int64_t need = 8ll * pr.num_counters;
      if (a.counters_bytes < need) {
        TIDE_PLAN_CHECK(a.counters_offset + a.counters_bytes >= a.total, "counter_base ", base,
                        ": the programs' counters region does not end the arena; pass arena=");
        a.counters_bytes = (need + 255) / 256 * 256;
        a.total = a.counters_offset + a.counters_bytes;
      }
    }
  }
}

}  // namespace tide
