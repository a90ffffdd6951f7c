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
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "tide/session.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

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
    s->session = std::make_unique<GroupSession>(call.plan, make(s->arena), p);
    st = std::move(s);
  }
  return *st;
}

std::vector<RankBindingList> bindings_for(const GroupCall& call) {
  const Plan& plan = *call.plan;
  const GroupLayout& lay = plan.layout;
  std::vector<RankBindingList> b(static_cast<size_t>(lay.N));
  for (int r = 0; r < lay.N; ++r) {
    const RankIo& io = *call.ranks[static_cast<size_t>(r)];
    RankBindingList& l = b[static_cast<size_t>(r)];
    if (call.spec.op == Collective::kAllGather) {
      const int b_shard = dtype_size(plan.sig.shard_dtype);
      for (int p = 0; p < lay.P; ++p)
        l.push_back({BufKind::kShard, p, const_cast<void*>(io.in[p]), lay.params[p].e * b_shard});
    } else {
      const int b_grad = dtype_size(plan.sig.grad_dtype);
      for (int p = 0; p < lay.P; ++p)
        l.push_back({BufKind::kGrad, p, const_cast<void*>(io.in[p]), lay.params[p].D * lay.params[p].K * b_grad});
      l.push_back({BufKind::kOut, -1, io.out[0], lay.S_fp32});
    }
  }
  return b;
}

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
  // With accumulate XLA aliases the accumulator to the result; copy only if it did not.
  if (call.spec.op == Collective::kReduceScatter && call.spec.accumulate)
    for (const RankIo* io : call.ranks)
      if (io->acc[0] != io->out[0]) std::memcpy(io->out[0], io->acc[0], static_cast<size_t>(call.plan->layout.S_fp32));
  run_session(st, call, {});
}

void CompleteRank(const GroupCall& call, int rank) {
  if (call.spec.cuda) {
#ifdef TIDE_WITH_CUDA
    CompleteRankCuda(call, rank);
#endif
    return;
  }
  if (call.spec.op != Collective::kAllGather) return;  // TIDE-RS wrote XLA's result in place
  GroupState& st = cpu_state(call);
  auto& ex = static_cast<CpuClusterExecutor&>(st.session->executor());
  const GroupLayout& lay = call.plan->layout;
  const int b_ag = dtype_size(call.plan->sig.ag_dtype);
  const uint8_t* ring = ex.arena().region(rank, BufKind::kRing0);
  const RankIo& io = *call.ranks[static_cast<size_t>(rank)];
  for (int p = 0; p < lay.P; ++p) {
    const ParamLayout& pl = lay.params[p];
    std::memcpy(io.out[p], ring + pl.o * lay.N, static_cast<size_t>(pl.D * pl.K * b_ag));
  }
}

}  // namespace tide::xla_ffi
