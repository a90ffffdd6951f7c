// The XLA face's session states ([Note: the executor boundary] in executor.cc): its keys into the
// core's SessionRegistry (tide/session_registry.h) — one GroupSession per (mesh, plan, collective,
// mesh group, virtual device[, rank devices]) of this process, or per (collective, plan, mesh,
// group, rank) for a mesh spanning processes —, their placement, and the bindings of XLA's
// buffers. Both executor paths use them (executor.cc for the CPU and the entry points,
// executor_cuda.cc for CUDA); this file calls neither. Their lifetime: [Note: state lifetime] in
// tide_ffi.h.
#include "tide/session.h"
#include "tide/session_registry.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

// Wherever the plan has a cast, on any number of nodes: one node pulls the peers' staged shards,
// several keep the Bruck rounds and pull the peers' round areas ([Note: pull landing across nodes]
// in csrc/program/ag_program.cc). The pull programs' arena holds their stage and counters only
// ([Note: pulled arena] in tide/plan.h): no ring slots, no TIDE-RS regions.
bool pull_landing(const Plan& plan) { return plan.sig.needs_cast(); }

namespace {
bool pulls(Collective op, const Plan& plan) { return op == Collective::kAllGather && pull_landing(plan); }
}  // namespace

Rails rails_in_use(const ExecutorOptions& opt) { return with_debug_env(opt).rails; }

ArenaSpec group_arena(const Plan& plan, Collective op, Rails rails) {
  return GroupSession::own_arena(plan, {op}, rails, pulls(op, plan));
}

RankArena group_rank_arena(const Plan& plan, Collective op, Rails rails) {
  return rank_arena(plan, op, rails, pulls(op, plan));
}

SessionRegistry& session_states() {
  // Never destroyed at exit: its streams and arenas would otherwise be torn down in a static
  // destructor, after the CUDA runtime may already have shut down (release_table frees them).
  static auto* registry = new SessionRegistry(
      "the TIDE states of this mesh were released (tide_xla.release, or a re-init of the mesh); call "
      "tide_xla.init(mesh, axis) again before running TIDE calls on it");
  return *registry;
}

namespace {

// The XLA face's placement of a group in its session's own arena.
GroupPlacement xla_placement(Collective op, int64_t group, const Plan& plan) {
  GroupPlacement p;
  p.kinds = {op};
  p.group = static_cast<int32_t>(group);
  p.resident = false;  // XLA owns the shards: read them in place (kShard)
  p.pull_landing = pulls(op, plan);
  return p;
}

}  // namespace

std::shared_ptr<SessionState> group_state(const GroupCall& call, const std::vector<int>* devices,
                                          const std::function<std::shared_ptr<CallExecutor>(const ArenaSpec&)>& make) {
  SessionKey key = {0, static_cast<int64_t>(call.table), static_cast<int64_t>(call.plan->hash),
                    static_cast<int64_t>(call.spec.op), call.group, call.virtual_device};
  if (devices) key.insert(key.end(), devices->begin(), devices->end());
  return session_states().get_or_make(key, call.table, [&] {
    auto s = std::make_shared<SessionState>();
    // Laid out for the rails the executor will run on (its options as it reads them), so the
    // counters region holds the programs as the session lowers them.
    const Rails rails = rails_in_use(executor_options_for(call));
    s->arena = group_arena(*call.plan, call.spec.op, rails);
    s->cuda = call.spec.cuda;
    std::shared_ptr<CallExecutor> executor = make(s->arena);
    TIDE_CHECK(executor->rails() == rails, "group ", call.group, " (", target_name(call.spec.op), "): its arena was "
               "laid out for ", rails_name(rails), " rails, its executor runs ", rails_name(executor->rails()));
    s->session = std::make_unique<GroupSession>(call.plan, std::move(executor),
                                                xla_placement(call.spec.op, call.group, *call.plan));
    // One arena per rank: on each rank's device (CUDA), or host memory.
    if (devices)
      for (int d : *devices) s->counted.emplace_back(d, s->arena.total);
    else
      s->counted.emplace_back(-1, s->arena.total * call.plan->layout.N);
    return s;
  });
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

int64_t run_session(SessionState& st, const GroupCall& call, const std::vector<uintptr_t>& streams) {
  std::vector<RankBindingList> b;
  for (int r = 0; r < call.plan->layout.N; ++r) b.push_back(rank_bindings(call, *call.ranks[static_cast<size_t>(r)]));
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

SessionKey RankStateKey::key() const {
  return {1, static_cast<int64_t>(op), static_cast<int64_t>(plan_hash), static_cast<int64_t>(table), group, rank};
}

void put_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan, std::shared_ptr<CallExecutor> executor,
                    const RankArena& arena, Rails rails, const uint8_t* own_arena, bool cuda, int device) {
  TIDE_PLAN_CHECK(!session_states().released(key.table), session_states().released_message());
  TIDE_CHECK(executor->rails() == rails, "rank ", key.rank, " of group ", key.group, " (", target_name(key.op),
             "): its arena was laid out for ", rails_name(rails), " rails, its executor runs ",
             rails_name(executor->rails()));
  auto st = std::make_shared<SessionState>();
  st->rank_state = true;
  GroupPlacement p = xla_placement(key.op, key.group, *plan);
  // An executor with an arena layout (CUDA) takes the programs' counters from the region's start.
  if (executor->regions() != nullptr) p.counter_base[static_cast<int>(key.op)] = 0;
  st->session = std::make_unique<GroupSession>(std::move(plan), std::move(executor), p);
  auto ring = arena.regions.find("ring0");
  st->ring0 = ring == arena.regions.end() ? -1 : ring->second.first;
  st->arena_base = own_arena;
  st->cuda = cuda;
  st->counted.emplace_back(device, arena.bytes);
  session_states().put(key.key(), key.table, std::move(st));
}

}  // namespace tide::xla_ffi
