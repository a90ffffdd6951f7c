// The XLA face's session states ([Note: the executor boundary] in executor.cc): one GroupSession
// per (plan, collective, mesh group, virtual device[, rank devices]) of this process, or per
// (collective, plan, mesh, group, rank) for a mesh spanning processes, and the bindings of XLA's
// buffers. Both executor paths use them (executor.cc for the CPU and the entry points,
// executor_cuda.cc for CUDA); this file calls neither.
#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "tide/session.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

bool pull_landing(const Plan& plan) { return plan.topo.nodes == 1 && plan.sig.needs_cast(); }

GroupState& group_state(const GroupCall& call, const std::vector<int>* devices,
                        const std::function<std::shared_ptr<CallExecutor>(const ArenaSpec&)>& make) {
  std::ostringstream key;
  key << call.plan->hash << '|' << int(call.spec.op) << '|' << call.group << '|' << call.virtual_device << '|';
  if (devices)
    for (int d : *devices) key << d << ',';
  static std::mutex mu;
  // Never destroyed: their streams and arenas would otherwise be torn down in a static
  // destructor, after the CUDA runtime may already have shut down.
  static auto* states = new std::map<std::string, std::unique_ptr<GroupState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& st = (*states)[key.str()];
  if (!st) {
    const Collective kind = call.spec.op;
    auto s = std::make_unique<GroupState>();
    s->arena = GroupSession::own_arena(*call.plan, {kind});
    GroupPlacement p;
    p.kinds = {kind};
    p.group = static_cast<int32_t>(call.group);
    p.resident = false;  // XLA owns the shards: read them in place (kShard)
    p.pull_landing = kind == Collective::kAllGather && pull_landing(*call.plan);
    s->session = std::make_unique<GroupSession>(call.plan, make(s->arena), p);
    st = std::move(s);
  }
  return *st;
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
// Never destroyed (like the in-process states): the mappings live as long as the process.
auto* g_rank_states = new std::map<RankStateKey, std::unique_ptr<RankState>>();

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
                    const RankArena& arena, const uint8_t* own_arena, bool cuda) {
  auto st = std::make_unique<RankState>();
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
  std::lock_guard<std::mutex> lock(g_rank_mu);
  auto& slot = (*g_rank_states)[key];
  if (!slot) slot = std::move(st);
}

RankState* find_rank_state(const RankStateKey& key) {
  std::lock_guard<std::mutex> lock(g_rank_mu);
  auto it = g_rank_states->find(key);
  return it == g_rank_states->end() ? nullptr : it->second.get();
}

}  // namespace tide::xla_ffi
