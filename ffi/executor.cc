// [Note: the executor boundary] With executor_cuda.cc, the one place where ffi/ reaches TIDE's
// core: each group's calls go through the call runtime (tide/session.h), a GroupSession over a
// CPU virtual-cluster executor (XLA:CPU) or the CUDA in-process executor (executor_cuda.cc).
//
// XLA already runs one thread per device, and the rendezvous has every rank's buffers before the
// executor is called. The executor steps all ranks of a call itself, so rank 0 of the group runs
// one call for every rank (ExecuteGroup) while the other device threads wait in the rendezvous;
// each rank then does its own completion work (CompleteRank).
//
// Buffers (the push rule of program.h: a rank touches user buffers of its own rank only):
//   TIDE-AG  shard[p] <- XLA operand p (R_p rows, padded); the landing is the arena's ring slot 0;
//            CompleteRank copies rank r's landing rows [0, D_p) of each parameter into XLA
//            result p. That copy is the one the XLA face adds: XLA allocates its results, and
//            peers may only write arena memory.
//   TIDE-RS  grad[p] <- XLA operand p (read in place); out <- XLA's packed fp32 result (written
//            in place; with accumulate it is the donated accumulator, aliased by XLA).
//
// State per (plan, collective, mesh group, virtual device[, rank devices]): the executor (its
// arena) and the session. Counters are epochs and never reset, so the state lives as long as the
// process; calls of one state are serialised by the session.
//
// A mesh spanning processes: one state per (collective, plan, mesh, group, rank) of this process
// instead, a session over a rank executor (XLA:CPU: a CPU RankExecutor mapping every rank's shm
// segment; CUDA: executor_cuda.cc's CudaProcessRank); each device runs RunRankCall for its own
// rank ([Note: cross-process ranks] below).
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

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
    const CallKind kind =
        call.spec.op == Collective::kAllGather ? CallKind::kAllGather : CallKind::kReduceScatter;
    auto s = std::make_unique<GroupState>();
    s->arena = GroupSession::own_arena(*call.plan, {kind});
    GroupPlacement p;
    p.kinds = {kind};
    p.group = static_cast<int32_t>(call.group);
    p.resident = false;  // XLA owns the shards: read them in place (kShard)
    p.pull_landing = kind == CallKind::kAllGather && pull_landing(*call.plan);
    s->session = std::make_unique<GroupSession>(call.plan, make(s->arena), p);
    st = std::move(s);
  }
  return *st;
}

namespace {

// Rank `io.rank`'s XLA buffers as the session's bindings.
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

std::vector<RankBindingList> bindings_for(const GroupCall& call) {
  std::vector<RankBindingList> b;
  for (int r = 0; r < call.plan->layout.N; ++r) b.push_back(rank_bindings(call, *call.ranks[static_cast<size_t>(r)]));
  return b;
}

// TIDE-AG landing rows [0, D_p) of every parameter (ring slot 0 at `ring`) -> XLA's results.
void copy_landing(const GroupCall& call, const uint8_t* ring, const RankIo& io) {
  const GroupLayout& lay = call.plan->layout;
  const int b_ag = dtype_size(call.plan->sig.ag_dtype);
  for (int p = 0; p < lay.P; ++p) {
    const ParamLayout& pl = lay.params[p];
    std::memcpy(io.out[p], ring + pl.o * lay.N, static_cast<size_t>(pl.D * pl.K * b_ag));
  }
}

// RS with accumulate: XLA aliases the accumulator to the result; copy only if it did not.
void seed_accumulator(const GroupCall& call, const RankIo& io) {
  if (call.spec.op == Collective::kReduceScatter && call.spec.accumulate && io.acc[0] != io.out[0])
    std::memcpy(io.out[0], io.acc[0], static_cast<size_t>(call.plan->layout.S_fp32));
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

namespace {

GroupState& cpu_state(const GroupCall& call) {
  return group_state(call, nullptr, [&](const ArenaSpec& spec) {
    return std::make_shared<CpuClusterExecutor>(call.plan->topo.world(), spec, false, executor_options_for(call));
  });
}

}  // namespace

bool executor_available() { return true; }

std::string executor_description() {
  return "TIDE's call runtime over the CPU executor (threads) or the CUDA in-process executor";
}

void ExecuteGroup(const GroupCall& call) {
  if (call.spec.cuda) {
#ifdef TIDE_WITH_CUDA
    ExecuteGroupCuda(call);
    return;
#else
    throw Unimplemented("a CUDA call reached a build without the CUDA executor");
#endif
  }
  GroupState& st = cpu_state(call);
  for (const RankIo* io : call.ranks) seed_accumulator(call, *io);
  run_session(st, call, {});
}

void CompleteRank(const GroupCall& call, int rank) {
  if (call.spec.cuda) {
#ifdef TIDE_WITH_CUDA
    CompleteRankCuda(call, rank);
#endif
    return;
  }
  // TIDE-RS wrote XLA's result in place; a pull landing wrote XLA's AG results in place.
  if (call.spec.op != Collective::kAllGather || pull_landing(*call.plan)) return;
  GroupState& st = cpu_state(call);
  auto& ex = static_cast<CpuClusterExecutor&>(st.session->executor());
  copy_landing(call, ex.arena().region(rank, BufKind::kRing0), *call.ranks[static_cast<size_t>(rank)]);
}

// ---- Ranks across processes ------------------------------------------------------------------
// [Note: cross-process ranks] Each rank's own device thread runs only its program (the push rule
// keeps every XLA buffer of rank r to rank r's program), so nothing meets in this process: peers
// in this or other processes synchronise through the counters in each other's segments, and the
// rank executor's entry fence keeps call k+1 out of a peer still in call k (docs/rank_executor.md),
// which also protects a landing until its rank has copied it out (on CUDA the copy is on XLA's
// stream, whose prior work the next call's streams wait for before its fence). Bytes out equal
// the in-process cluster's: the same programs through the same op interpreter (step_ranks) or
// the same kernels.

bool RankStateKey::operator<(const RankStateKey& o) const {
  return std::tie(op, plan_hash, table, group, rank) < std::tie(o.op, o.plan_hash, o.table, o.group, o.rank);
}

namespace {

std::mutex g_rank_mu;
// Never destroyed (like the in-process states): the mappings live as long as the process.
auto* g_rank_states = new std::map<RankStateKey, std::unique_ptr<RankState>>();

CallKind call_kind(Collective op) {
  return op == Collective::kAllGather ? CallKind::kAllGather : CallKind::kReduceScatter;
}

}  // namespace

RankArena rank_arena(const Plan& plan, Collective op, Rails rails) {
  const ArenaSpec a = GroupSession::own_arena(plan, {call_kind(op)}, rails);
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
  p.kinds = {call_kind(key.op)};
  p.group = static_cast<int32_t>(key.group);
  p.resident = false;  // XLA owns the shards: read them in place (kShard)
  p.pull_landing = key.op == Collective::kAllGather && pull_landing(*plan);
  // An executor with an arena layout (CUDA) takes the programs' counters from the region's start.
  if (st->executor->regions() != nullptr) p.counter_base[static_cast<int>(call_kind(key.op))] = 0;
  st->session = std::make_unique<GroupSession>(std::move(plan), st->executor, p);
  auto ring = arena.regions.find("ring0");
  st->ring0 = ring == arena.regions.end() ? -1 : ring->second.first;
  st->arena = own_arena;
  st->cuda = cuda;
  std::lock_guard<std::mutex> lock(g_rank_mu);
  auto& slot = (*g_rank_states)[key];
  if (!slot) slot = std::move(st);
}

void open_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan,
                     const std::vector<std::string>& segments, int64_t timeout_ms) {
  TIDE_PLAN_CHECK(plan != nullptr && plan->hash == key.plan_hash, "open_rank_state: the plan does not match the key");
  TIDE_PLAN_CHECK(timeout_ms > 0, "timeout_ms: must be > 0, got ", timeout_ms);
  if (has_rank_state(key)) return;
  const RankArena arena = rank_arena(*plan, key.op);
  ExecutorOptions opt;
  opt.timeout_s = static_cast<double>(timeout_ms) / 1000.0;
  auto ex = std::make_shared<RankExecutor>(key.rank, plan->topo, segments, arena.bytes, arena.regions, opt);
  auto call_ex = std::make_shared<CpuRankExecutor>(ex, RegionTable{});  // own arena: counters from 0
  put_rank_state(key, std::move(plan), call_ex, arena, ex->segment(key.rank), false);
}

void RunRankCall(const GroupCall& call, uint64_t table, const RankIo& io) {
  RankStateKey key{call.spec.op, call.plan->hash, table, call.group, io.rank};
  RankState* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_rank_mu);
    auto it = g_rank_states->find(key);
    if (it != g_rank_states->end()) st = it->second.get();
  }
  if (st == nullptr)
    throw PlanError(TIDE_STR_CAT(
        "rank ", io.rank, " of group ", call.group, " (process ", process_index(), "): no cross-process state for this ",
        collective_name(call.spec.op), " (plan hash ", call.plan->hash, "); the mesh spans processes, so the call must "
        "be traced through tide_xla (gather / reduce_scatter), which prepares it on every process"));
  TIDE_CHECK(st->cuda == call.spec.cuda, "rank ", io.rank, ": a ", call.spec.cuda ? "CUDA" : "CPU", " call reached a ",
             st->cuda ? "CUDA" : "CPU", " rank state");
  // CUDA: the call is enqueued on XLA's stream (the rank executor's streams wait for its prior
  // work, the accumulator copy included, and it waits for the call): no host synchronisation.
  std::vector<uintptr_t> streams;
  if (st->cuda) {
#ifdef TIDE_WITH_CUDA
    if (call.spec.op == Collective::kReduceScatter && call.spec.accumulate)
      copy_accumulator_async(io, call.plan->layout.S_fp32);
    streams.push_back(reinterpret_cast<uintptr_t>(io.stream));
#endif
  } else {
    seed_accumulator(call, io);
  }
  const std::vector<RankBindingList> b = {rank_bindings(call, io)};
  if (call.spec.op == Collective::kAllGather) {
    st->session->all_gather(b, streams);
    if (pull_landing(*call.plan)) return;  // landed in XLA's results
    TIDE_CHECK(st->ring0 >= 0, "cross-process TIDE-AG: the arena has no ring0 region");
    if (!st->cuda) {
      copy_landing(call, st->arena + st->ring0, io);
    } else {
#ifdef TIDE_WITH_CUDA
      copy_landing_async(call, reinterpret_cast<const char*>(st->arena) + st->ring0, io);
#endif
    }
  } else {
    st->session->reduce_scatter(call.spec.scale, call.spec.accumulate, b, streams);
  }
}

}  // namespace tide::xla_ffi
