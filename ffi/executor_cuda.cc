// TIDE's CUDA executor behind the XLA FFI handlers ([Note: the executor boundary], executor.cc).
// Called only from executor.cc (and the handlers' accumulator copy); it calls only the session
// states (session_state.cc) and the core, never back into executor.cc.
//
// One process: the ranks of a group are XLA devices of this process (rank r on its device
// ordinal; a virtual cluster puts every rank on one device), so the group runs on the core's CUDA
// in-process executor (tide/cuda.h) through its GroupSession, exactly as the CUDA virtual cluster
// runs it. Rank 0's handler thread enqueues the call for every rank after the rendezvous; nothing
// here waits on the host. Several processes: each rank's own CudaProcessRank ([Note: CUDA rank
// states] below), whose calls RunRankCall (executor.cc) runs on the rank's XLA stream.
//
// [Note: stream handoff] The session's executor takes every rank's XLA stream as that rank's
// caller stream: the call's internal streams wait for the XLA stream's prior work (the other
// ranks' handler threads are blocked in the rendezvous meanwhile, so their streams hold exactly
// what preceded this call, the accumulator copy included), and each XLA stream waits for the
// whole call. CompleteRank (rank r's thread) then enqueues TIDE-AG's copy of rank r's landing into
// XLA's results on rank r's XLA stream, where the next call's handoff orders it before that
// call's readiness signals (peers never push into a landing XLA's stream is still reading). A
// pulled plan (a cast, any number of nodes: pull_landing in session_state.cc) has no such copy:
// the rank's own pulls wrote XLA's results, and its XLA stream waits for them with the call.
//
// Errors: construction and enqueue errors throw as on the CPU (PlanError -> INVALID_ARGUMENT, a
// wait whose producer is never issued -> TimeoutError -> DEADLINE_EXCEEDED). A wait that is late
// on the device is released by the executor's watchdog and reported by a later call; with
// TIDE_EXEC_OPTIONS=sync_every_call=1 the executor synchronises after every call (debugging: that
// error then becomes DEADLINE_EXCEEDED of the call).
#ifdef TIDE_WITH_CUDA
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "tide/cuda.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

namespace {

std::vector<int> devices_of(const GroupCall& call) {
  std::vector<int> d;
  for (const RankIo* io : call.ranks) d.push_back(io->device);
  return d;
}

std::shared_ptr<SessionState> cuda_state(const GroupCall& call) {
  const std::vector<int> devices = devices_of(call);  // group_state counts each rank's arena on its device
  return group_state(call, &devices, [&](const ArenaSpec& spec) {
    return make_cuda_cluster_executor(devices, spec.total, executor_options_for(call));
  });
}

}  // namespace

std::string cuda_executor_missing() {
  const int n = cuda::device_count();
  return n > 0 ? std::string() : "no CUDA device is visible (cudaGetDeviceCount found none)";
}

void copy_accumulator_async(const RankIo& io, int64_t bytes) {
  if (io.acc.empty() || io.acc[0] == io.out[0]) return;  // XLA aliased it: in place already
  cuda::DeviceGuard guard(io.device, "the accumulator copy: ");  // XLA's threads keep their own device
  TIDE_CHECK_CUDA(cudaMemcpyAsync(io.out[0], io.acc[0], static_cast<size_t>(bytes),
                                  cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(io.stream)),
                  "accumulator -> result");
}

void ExecuteGroupCuda(const GroupCall& call) {
  const int N = call.plan->layout.N;
  TIDE_CHECK(static_cast<int>(call.ranks.size()) == N, "ExecuteGroupCuda: ", call.ranks.size(),
             " ranks for a group of ", N);
  std::vector<uintptr_t> streams;
  for (int r = 0; r < N; ++r) {
    const RankIo& io = *call.ranks[static_cast<size_t>(r)];
    TIDE_CHECK(io.device >= 0 && io.stream != nullptr, "rank ", r, ": no device or XLA stream");
    streams.push_back(reinterpret_cast<uintptr_t>(io.stream));
  }
  cuda::DeviceGuard guard(call.ranks[0]->device, "ExecuteGroupCuda: ");  // XLA's threads keep their own device
  run_session(*cuda_state(call), call, streams);
}

void copy_landing_async(const GroupCall& call, const char* ring, const RankIo& io) {
  cuda::DeviceGuard guard(io.device, "the landing copy: ");  // XLA's threads keep their own device
  // The one copy of the XLA face: rank r's landing rows [0, D_p) -> XLA result p.
  const GroupLayout& lay = call.plan->layout;
  const int b_ag = dtype_size(call.plan->sig.ag_dtype);
  std::vector<DeviceCopy> copies;
  for (int p = 0; p < lay.P; ++p) {
    const ParamLayout& pl = lay.params[p];
    copies.push_back({io.out[p], ring + pl.o * lay.N, static_cast<size_t>(pl.D * pl.K * b_ag)});
  }
  copy_async(copies, reinterpret_cast<uintptr_t>(io.stream));
}

void CompleteRankCuda(const GroupCall& call, int rank) {
  // TIDE-RS wrote XLA's result in place; a pull landing wrote XLA's AG results in place.
  if (call.spec.op != Collective::kAllGather || pull_landing(*call.plan)) return;
  const RankIo& io = *call.ranks.at(static_cast<size_t>(rank));
  const std::shared_ptr<SessionState> st = cuda_state(call);
  copy_landing_async(call, cuda_cluster_arena(st->session->executor(), rank) +
                               st->arena.offset[static_cast<int>(BufKind::kRing0)], io);
}

// ---- Ranks across processes on CUDA ----------------------------------------------------------
// [Note: CUDA rank states] One CudaProcessRank per (collective, plan, mesh, group, rank) of this
// process: its own IPC arena, laid out as group_rank_arena() (the session's own layout on its
// rails plus the entry fence's counter), and its own rail communicator. Between create and
// connect the handle and the rail id travel through jax.distributed's store
// (tide_xla/processes.py); a rank waits there, so a missing process is a TimeoutError naming
// it. Here only the rail's construction waits (NCCL's init among the rail's processes, which
// have all passed that exchange). The states live until
// tide_xla.release of their mesh, which every process calls after its last step and a barrier
// (their peers may push into the arena until the last call of every process). A process holding
// several ranks of a node connects each with the others of its group ([Note: same-process peers]
// in csrc/fabric/ipc.h), so a connected rank stays listed here until the release; it joins its
// rail in (group, rank) order, which is rail order on every process (all of a process's ranks are
// on its node): no process waits on a rail another reaches only after one it waits on.
namespace {

struct PendingRank {
  std::shared_ptr<const Plan> plan;
  std::shared_ptr<CudaProcessRank> rank;
  int64_t timeout_ms = 0;
  int device = -1;
  bool connected = false;
};

std::mutex g_pending_mu;
auto* g_pending = new std::map<RankStateKey, PendingRank>();

// The rails a rank of `topo` runs on: two-sided across nodes (CudaProcessRank::rails_for, what
// connect() gives its executor), as its executor reads its options.
Rails cuda_rank_rails(const Topology& topo) {
  ExecutorOptions o;
  o.rails = CudaProcessRank::rails_for(topo);
  return rails_in_use(o);
}

}  // namespace

std::string create_cuda_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan, int device,
                                   int64_t timeout_ms) {
  TIDE_PLAN_CHECK(plan != nullptr && plan->hash == key.plan_hash, "create_cuda_rank_state: the plan does not match");
  TIDE_PLAN_CHECK(timeout_ms > 0, "timeout_ms: must be > 0, got ", timeout_ms);
  std::lock_guard<std::mutex> lock(g_pending_mu);
  auto it = g_pending->find(key);
  if (it != g_pending->end()) {
    TIDE_CHECK(!it->second.connected, "create_cuda_rank_state: rank ", key.rank, " is connected already");
    return it->second.rank->ipc_handle();
  }
  const RankArena arena = group_rank_arena(*plan, key.op, cuda_rank_rails(plan->topo));
  PendingRank p;
  p.rank = std::make_shared<CudaProcessRank>(key.rank, plan->topo, device, arena.bytes);
  p.device = device;  // counted once connected (put_rank_state)
  p.plan = std::move(plan);
  p.timeout_ms = timeout_ms;
  std::string handle = p.rank->ipc_handle();
  g_pending->emplace(key, std::move(p));
  return handle;
}

void connect_cuda_rank_state(const RankStateKey& key, const std::vector<std::string>& handles,
                             const std::string& rail_id) {
  PendingRank p;
  std::vector<std::shared_ptr<CudaProcessRank>> others;  // this process's other ranks of the group
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    auto it = g_pending->find(key);
    TIDE_CHECK(it != g_pending->end() && !it->second.connected, "connect_cuda_rank_state: rank ", key.rank,
               " of group ", key.group, " was not created (create_cuda_rank_state first) or is connected already");
    p = it->second;
    for (const auto& [k, q] : *g_pending)
      if (k.op == key.op && k.plan_hash == key.plan_hash && k.table == key.table && k.group == key.group &&
          k.rank != key.rank)
        others.push_back(q.rank);
  }
  const Rails rails = cuda_rank_rails(p.plan->topo);
  const RankArena arena = group_rank_arena(*p.plan, key.op, rails);
  ExecutorOptions opt;
  opt.timeout_s = static_cast<double>(p.timeout_ms) / 1000.0;
  std::vector<const CudaProcessRank*> local;
  for (const auto& o : others) local.push_back(o.get());
  std::shared_ptr<CallExecutor> ex = p.rank->connect(handles, rail_id, arena.regions, opt, local);
  const auto* base = reinterpret_cast<const uint8_t*>(p.rank->arena());
  // The executor keeps the arena, the same-process peers' and the rail.
  put_rank_state(key, p.plan, std::move(ex), arena, rails, base, true, p.device);
  std::lock_guard<std::mutex> lock(g_pending_mu);
  auto it = g_pending->find(key);
  if (it != g_pending->end()) it->second.connected = true;
}

int64_t release_pending_cuda(uint64_t table) {
  std::vector<PendingRank> gone;
  int64_t pending = 0;  // connected ranks are counted as the states they became
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    for (auto it = g_pending->begin(); it != g_pending->end();) {
      if (it->first.table != table) {
        ++it;
        continue;
      }
      pending += it->second.connected ? 0 : 1;
      gone.push_back(std::move(it->second));
      it = g_pending->erase(it);
    }
  }
  return pending;  // arenas no executor holds are freed here, outside the lock
}

}  // namespace tide::xla_ffi

#endif  // TIDE_WITH_CUDA
