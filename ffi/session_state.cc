// The XLA face's session states ([Note: the executor boundary] in executor.cc): one GroupSession
// per (plan, collective, mesh group, virtual device[, rank devices]) of this process, or per
// (collective, plan, mesh, group, rank) for a mesh spanning processes, and the bindings of XLA's
// buffers. Both executor paths use them (executor.cc for the CPU and the entry points,
// executor_cuda.cc for CUDA); this file calls neither. Their lifetime: [Note: state lifetime] in
// tide_ffi.h.
#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>

#include "tide/session.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

bool pull_landing(const Plan& plan) { return plan.topo.nodes == 1 && plan.sig.needs_cast(); }

namespace {

std::mutex g_state_mu;  // the group states, the released tables and the arena counts
// Never destroyed at exit: their streams and arenas would otherwise be torn down in a static
// destructor, after the CUDA runtime may already have shut down (release_table frees them).
auto* g_group_states = new std::map<std::string, std::shared_ptr<GroupState>>();
auto* g_released = new std::set<uint64_t>();
auto* g_arena_bytes = new std::map<int, int64_t>();  // device (-1: host) -> bytes of live states

std::string released_message(uint64_t table) {
  return TIDE_STR_CAT("the TIDE states of this mesh (device table ", table, ") were released "
                      "(tide_xla.release, or a re-init of the mesh); call tide_xla.init(mesh, axis) "
                      "again before running TIDE calls on it");
}

}  // namespace

void count_arena(int device, int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_state_mu);
  (*g_arena_bytes)[device] += bytes;
}

int64_t device_arena_bytes(int device) {
  std::lock_guard<std::mutex> lock(g_state_mu);
  auto it = g_arena_bytes->find(device);
  return it == g_arena_bytes->end() ? 0 : it->second;
}

void open_table(uint64_t table) {
  std::lock_guard<std::mutex> lock(g_state_mu);
  g_released->erase(table);
}

bool table_released(uint64_t table) {
  std::lock_guard<std::mutex> lock(g_state_mu);
  return g_released->count(table) > 0;
}

std::shared_ptr<GroupState> group_state(const GroupCall& call, const std::vector<int>* devices,
                                        const std::function<std::shared_ptr<CallExecutor>(const ArenaSpec&)>& make) {
  std::ostringstream key;
  key << call.table << '|' << call.plan->hash << '|' << int(call.spec.op) << '|' << call.group << '|'
      << call.virtual_device << '|';
  if (devices)
    for (int d : *devices) key << d << ',';
  std::lock_guard<std::mutex> lock(g_state_mu);
  TIDE_PLAN_CHECK(!g_released->count(call.table), released_message(call.table));
  auto& st = (*g_group_states)[key.str()];
  if (!st) {
    const Collective kind = call.spec.op;
    auto s = std::make_shared<GroupState>();
    s->arena = GroupSession::own_arena(*call.plan, {kind});
    s->table = call.table;
    GroupPlacement p;
    p.kinds = {kind};
    p.group = static_cast<int32_t>(call.group);
    p.resident = false;  // XLA owns the shards: read them in place (kShard)
    p.pull_landing = kind == Collective::kAllGather && pull_landing(*call.plan);
    s->session = std::make_unique<GroupSession>(call.plan, make(s->arena), p);
    // One arena per rank: on each rank's device (CUDA), or host memory.
    if (devices)
      for (int d : *devices) s->counted.emplace_back(d, s->arena.total);
    else
      s->counted.emplace_back(-1, s->arena.total * call.plan->layout.N);
    for (const auto& [d, bytes] : s->counted) (*g_arena_bytes)[d] += bytes;
    st = std::move(s);
  }
  return st;
}

RankBindingList rank_bindings(const GroupCall& call, const RankIo& io) {
  const Plan& plan = *call.plan;
  const GroupLayout& lay = plan.layout;
  RankBindingList l;
  if (call.spec.op == Collective::kAllGather) {
    const int b_shard = dtype_size(plan.sig.shard_dtype), b_ag = dtype_size(plan.sig.ag_dtype);
    for (int p = 0; p < lay.P; ++p)
      l.push_back({BufKind::kShard, p, const_cast<void*>(io.in[p]), lay.params[p].e * b_shard});
    if (pull_landing(plan))  // XLA's results are the landing: nothing to copy out
      for (int p = 0; p < lay.P; ++p)
        l.push_back({BufKind::kLanding, p, io.out[p], lay.params[p].D * lay.params[p].K * b_ag});
  } else {
    const int b_grad = dtype_size(plan.sig.grad_dtype);
    for (int p = 0; p < lay.P; ++p)
      l.push_back({BufKind::kGrad, p, const_cast<void*>(io.in[p]), lay.params[p].D * lay.params[p].K * b_grad});
    l.push_back({BufKind::kOut, -1, io.out[0], lay.S_fp32});
  }
  return l;
}

namespace {
std::vector<RankBindingList> bindings_for(const GroupCall& call) {
  std::vector<RankBindingList> b;
  for (int r = 0; r < call.plan->layout.N; ++r) b.push_back(rank_bindings(call, *call.ranks[static_cast<size_t>(r)]));
  return b;
}
}  // namespace

int64_t run_session(GroupState& st, const GroupCall& call, const std::vector<uintptr_t>& streams) {
  const std::vector<RankBindingList> b = bindings_for(call);
  if (call.spec.op == Collective::kAllGather) return st.session->all_gather(b, streams);
  return st.session->reduce_scatter(call.spec.scale, call.spec.accumulate, b, streams);
}

ExecutorOptions executor_options_for(const GroupCall& call) {
  ExecutorOptions o;
  o.timeout_s = static_cast<double>(call.timeout_ms) / 1000.0;
  return o;
}

bool RankStateKey::operator<(const RankStateKey& o) const {
  return std::tie(op, plan_hash, table, group, rank) < std::tie(o.op, o.plan_hash, o.table, o.group, o.rank);
}

namespace {

std::mutex g_rank_mu;
// Never destroyed at exit (like the in-process states); release_table frees them.
auto* g_rank_states = new std::map<RankStateKey, std::shared_ptr<RankState>>();

}  // namespace

RankArena rank_arena(const Plan& plan, Collective op, Rails rails) {
  const ArenaSpec a = GroupSession::own_arena(plan, {op}, rails);
  RankArena out;
  int64_t end = a.total;
  for (int k = static_cast<int>(BufKind::kRing0); k < kNumBufKinds; ++k) {
    if (a.offset[k] < 0 || a.bytes[k] <= 0) continue;
    out.regions[buf_kind_name(static_cast<BufKind>(k))] = {a.offset[k], a.bytes[k]};
    end = std::max(end, a.offset[k] + a.bytes[k]);
  }
  // The counters go last, one more for the rank executor's entry fence (its last counter).
  const int64_t off = (end + 63) / 64 * 64;
  const int64_t bytes = a.counters_bytes + 8;
  out.regions["counters"] = {off, bytes};
  out.bytes = (off + bytes + 63) / 64 * 64;
  return out;
}

bool has_rank_state(const RankStateKey& key) {
  std::lock_guard<std::mutex> lock(g_rank_mu);
  return g_rank_states->count(key) > 0;
}

void put_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan, std::shared_ptr<CallExecutor> executor,
                    const RankArena& arena, const uint8_t* own_arena, bool cuda, int device) {
  TIDE_PLAN_CHECK(!table_released(key.table), released_message(key.table));
  auto st = std::make_shared<RankState>();
  st->executor = std::move(executor);
  GroupPlacement p;
  p.kinds = {key.op};
  p.group = static_cast<int32_t>(key.group);
  p.resident = false;  // XLA owns the shards: read them in place (kShard)
  p.pull_landing = key.op == Collective::kAllGather && pull_landing(*plan);
  // An executor with an arena layout (CUDA) takes the programs' counters from the region's start.
  if (st->executor->regions() != nullptr) p.counter_base[static_cast<int>(key.op)] = 0;
  st->session = std::make_unique<GroupSession>(std::move(plan), st->executor, p);
  auto ring = arena.regions.find("ring0");
  st->ring0 = ring == arena.regions.end() ? -1 : ring->second.first;
  st->arena = own_arena;
  st->cuda = cuda;
  st->device = device;
  st->arena_bytes = arena.bytes;
  std::lock_guard<std::mutex> lock(g_rank_mu);
  auto& slot = (*g_rank_states)[key];
  if (!slot) {
    slot = std::move(st);
    count_arena(device, arena.bytes);
  }
}

std::shared_ptr<RankState> find_rank_state(const RankStateKey& key) {
  std::lock_guard<std::mutex> lock(g_rank_mu);
  auto it = g_rank_states->find(key);
  return it == g_rank_states->end() ? nullptr : it->second;
}

LiveStates live_states() {
  LiveStates out;
  {
    std::lock_guard<std::mutex> lock(g_rank_mu);
    out.rank_states = static_cast<int64_t>(g_rank_states->size());
  }
  std::lock_guard<std::mutex> lock(g_state_mu);
  out.group_states = static_cast<int64_t>(g_group_states->size());
  for (const auto& [d, bytes] : *g_arena_bytes) out.arena_bytes += bytes;
  return out;
}

int64_t release_states(uint64_t table) {
  std::vector<std::shared_ptr<GroupState>> groups;
  std::vector<std::shared_ptr<RankState>> ranks;
  {
    std::lock_guard<std::mutex> lock(g_rank_mu);
    for (auto it = g_rank_states->begin(); it != g_rank_states->end();) {
      if (it->first.table != table) {
        ++it;
        continue;
      }
      ranks.push_back(std::move(it->second));
      it = g_rank_states->erase(it);
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_state_mu);
    g_released->insert(table);  // from here a call on the table raises instead of building a state
    for (auto it = g_group_states->begin(); it != g_group_states->end();) {
      if (it->second->table != table) {
        ++it;
        continue;
      }
      groups.push_back(std::move(it->second));
      it = g_group_states->erase(it);
    }
    for (const auto& g : groups)
      for (const auto& [d, bytes] : g->counted) (*g_arena_bytes)[d] -= bytes;
    for (const auto& r : ranks) (*g_arena_bytes)[r->device] -= r->arena_bytes;
  }
  // Outside the locks: wait for each executor's enqueued work (CUDA; a no-op on the CPU), then
  // free. A call still in flight holds its own reference and frees the state when it returns.
  // A state whose work failed (the failing call already raised it) is freed all the same: the
  // error is printed, not raised, so a re-init after a failed call starts on fresh states.
  std::string first;
  for (const auto& g : groups) {
    try {
      g->session->executor().synchronize();
    } catch (const std::exception& e) {
      if (first.empty()) first = e.what();
    }
  }
  for (const auto& r : ranks) {
    try {
      r->executor->synchronize();
    } catch (const std::exception& e) {
      if (first.empty()) first = e.what();
    }
  }
  const auto n = static_cast<int64_t>(groups.size() + ranks.size());
  groups.clear();
  ranks.clear();
  if (!first.empty())
    std::fprintf(stderr, "tide_xla.release: freed states whose pending work had failed: %s\n", first.c_str());
  return n;
}

}  // namespace tide::xla_ffi
