// [Note: the executor boundary] The entry from ffi/'s handlers into TIDE's core: each group's
// calls go through the call runtime (tide/session.h), a GroupSession over a CPU virtual-cluster
// executor (XLA:CPU, here) or the CUDA in-process executor (executor_cuda.cc). The call path runs
// one way: executor.cc -> executor_cuda.cc -> session_state.cc (the sessions and bindings), and
// executor.cc -> session_state.cc; neither file below calls back into this one.
//
// XLA already runs one thread per device, and the rendezvous has every rank's buffers before the
// executor is called. The executor steps all ranks of a call itself, so rank 0 of the group runs
// one call for every rank (ExecuteGroup) while the other device threads wait in the rendezvous;
// each rank then does its own completion work (CompleteRank).
//
// Buffers (the push rule of program.h: a rank touches user buffers of its own rank only):
//   TIDE-AG  shard[p] <- XLA operand p (R_p rows, padded). With a cast (fp32 shards), on any
//            number of nodes, landing[p] <- XLA result p: the rank pulls its peers' stage areas
//            into it (pull_landing, session_state.cc) and nothing is copied. Without one (shards
//            in the AG dtype) the landing is the arena's ring slot 0 and CompleteRank copies rank
//            r's landing rows [0, D_p) of each parameter into XLA result p. That copy is the one
//            the XLA face adds: XLA allocates its results, and peers may only write arena memory.
//   TIDE-RS  grad[p] <- XLA operand p (read in place); out <- XLA's packed fp32 result (written
//            in place; with accumulate it is the donated accumulator, aliased by XLA).
//
// State per (mesh, plan, collective, mesh group, virtual device[, rank devices]): the executor (its
// arena) and the session. Counters are epochs and never reset, so a state lives until its mesh's
// states are released (release_table below; [Note: state lifetime] in tide_ffi.h); calls of one
// state are serialised by the session.
//
// A mesh spanning processes: one state per (collective, plan, mesh, group, rank) of this process
// instead, a session over a rank executor (XLA:CPU: a CPU RankExecutor mapping every rank's shm
// segment; CUDA: executor_cuda.cc's CudaProcessRank); each device runs RunRankCall for its own
// rank ([Note: cross-process ranks] below).
#include <algorithm>
#include <cstring>

#include "tide/session.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

namespace {

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

std::shared_ptr<SessionState> cpu_state(const GroupCall& call) {
  return group_state(call, nullptr, [&](const ArenaSpec& spec) {
    return std::make_shared<CpuClusterCallExecutor>(call.plan->topo.world(), spec, false, executor_options_for(call));
  });
}

}  // namespace

namespace {
// What keeps executor `kind` from running here ("" when nothing does).
std::string missing(const std::string& kind) {
  if (kind == "cpu") return "";  // the CPU executors are always linked and need no device
  TIDE_PLAN_CHECK(kind == "cuda", "executor_available: kind must be 'cpu' or 'cuda', got '", kind, "'");
#ifdef TIDE_WITH_CUDA
  return cuda_executor_missing();
#else
  return "tide_xla._ffi was built without CUDA (TIDE_CUDA=off or no nvcc at build time)";
#endif
}
}  // namespace

bool executor_available(const std::string& kind) { return missing(kind).empty(); }

std::string executor_description(const std::string& kind) {
  const std::string why = missing(kind);
  if (!why.empty()) return "the " + kind + " executor cannot run here: " + why;
  return kind == "cpu" ? "TIDE's call runtime over the CPU executors (virtual cluster: threads; rank executor: shm)"
                       : "TIDE's call runtime over the CUDA in-process and rank executors";
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
  const std::shared_ptr<SessionState> st = cpu_state(call);
  for (const RankIo* io : call.ranks) seed_accumulator(call, *io);
  run_session(*st, call, {});
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
  const std::shared_ptr<SessionState> st = cpu_state(call);
  auto& ex = static_cast<CpuClusterCallExecutor&>(st->session->executor());
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

void open_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan,
                     const std::vector<std::string>& segments, int64_t timeout_ms) {
  TIDE_PLAN_CHECK(plan != nullptr && plan->hash == key.plan_hash, "open_rank_state: the plan does not match the key");
  TIDE_PLAN_CHECK(timeout_ms > 0, "timeout_ms: must be > 0, got ", timeout_ms);
  if (session_states().has(key.key())) return;
  ExecutorOptions opt;
  opt.timeout_s = static_cast<double>(timeout_ms) / 1000.0;
  const Rails rails = rails_in_use(opt);  // group_plan's segment_bytes: the same layout
  const RankArena arena = group_rank_arena(*plan, key.op, rails);
  auto ex = std::make_shared<RankExecutor>(key.rank, plan->topo, segments, arena.bytes, arena.regions, opt);
  auto call_ex = std::make_shared<CpuRankCallExecutor>(ex, RegionTable{});  // own arena: counters from 0
  put_rank_state(key, std::move(plan), call_ex, arena, rails, ex->segment(key.rank), false, /*device=*/-1);
}

void RunRankCall(const GroupCall& call, uint64_t table, const RankIo& io) {
  const RankStateKey key{call.spec.op, call.plan->hash, table, call.group, io.rank};
  const std::shared_ptr<SessionState> st = session_states().find(key.key());
  if (st == nullptr && session_states().released(table))
    throw PlanError(TIDE_STR_CAT("rank ", io.rank, " of group ", call.group, ": the TIDE states of this mesh were "
                                 "released (tide_xla.release); call tide_xla.init(mesh, axis) again and re-trace"));
  if (st == nullptr)
    throw PlanError(TIDE_STR_CAT(
        "rank ", io.rank, " of group ", call.group, " (process ", process_index(), "): no cross-process state for this ",
        target_name(call.spec.op), " (plan hash ", call.plan->hash, "); the mesh spans processes, so the call must "
        "be traced through tide_xla (gather / reduce_scatter), which prepares it on every process; a function traced "
        "before tide_xla.release or a re-init of the mesh must be traced again"));
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
      copy_landing(call, st->arena_base + st->ring0, io);
    } else {
#ifdef TIDE_WITH_CUDA
      copy_landing_async(call, reinterpret_cast<const char*>(st->arena_base) + st->ring0, io);
#endif
    }
  } else {
    st->session->reduce_scatter(call.spec.scale, call.spec.accumulate, b, streams);
  }
}

int64_t release_table(uint64_t table) {
  int64_t n = 0;
#ifdef TIDE_WITH_CUDA
  n += release_pending_cuda(table);
#endif
  return n + session_states().release(table, "tide_xla.release");
}

}  // namespace tide::xla_ffi
