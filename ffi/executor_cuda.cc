// TIDE's CUDA executor behind the XLA FFI handlers ([Note: the executor boundary], executor.cc).
//
// One process: the ranks of a group are XLA devices of this process (rank r on its device
// ordinal; a virtual cluster puts every rank on one device), so the group runs on the core's CUDA
// in-process executor (tide/cuda.h) through its GroupSession, exactly as the CUDA virtual cluster
// runs it. Rank 0's handler thread enqueues the call for every rank after the rendezvous; nothing
// here waits on the host.
//
// [Note: stream handoff] The session's executor takes every rank's XLA stream as that rank's
// caller stream: the call's internal streams wait for the XLA stream's prior work (the other
// ranks' handler threads are blocked in the rendezvous meanwhile, so their streams hold exactly
// what preceded this call, the accumulator copy included), and each XLA stream waits for the
// whole call. CompleteRank (rank r's thread) then enqueues TIDE-AG's copy of rank r's landing into
// XLA's results on rank r's XLA stream, where the next call's handoff orders it before that
// call's readiness signals (peers never push into a landing XLA's stream is still reading).
//
// Errors: construction and enqueue errors throw as on the CPU (PlanError -> INVALID_ARGUMENT, a
// wait whose producer is never issued -> TimeoutError -> DEADLINE_EXCEEDED). A wait that is late
// on the device is released by the executor's watchdog and reported by a later call; with
// TIDE_EXEC_OPTIONS=sync_every_call=1 the executor synchronises after every call (debugging: that
// error then becomes DEADLINE_EXCEEDED of the call).
#ifdef TIDE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "tide/cuda.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

namespace {

// Restores the calling thread's CUDA device (XLA's threads keep their own).
class DeviceGuard {
 public:
  DeviceGuard() { TIDE_CHECK_CUDA(cudaGetDevice(&prev_)); }
  ~DeviceGuard() { cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

std::vector<int> devices_of(const GroupCall& call) {
  std::vector<int> d;
  for (const RankIo* io : call.ranks) d.push_back(io->device);
  return d;
}

GroupState& cuda_state(const GroupCall& call) {
  const std::vector<int> devices = devices_of(call);
  return group_state(call, &devices, [&](const ArenaSpec& spec) {
    return make_cuda_cluster_executor(devices, spec.total, executor_options_for(call));
  });
}

}  // namespace

void copy_accumulator_async(const RankIo& io, int64_t bytes) {
  if (io.acc.empty() || io.acc[0] == io.out[0]) return;  // XLA aliased it: in place already
  DeviceGuard guard;
  TIDE_CHECK_CUDA(cudaSetDevice(io.device), "device ", io.device);
  TIDE_CHECK_CUDA(cudaMemcpyAsync(io.out[0], io.acc[0], static_cast<size_t>(bytes),
                                  cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(io.stream)),
                  "accumulator -> result");
}

void ExecuteGroupCuda(const GroupCall& call) {
  DeviceGuard guard;
  const int N = call.plan->layout.N;
  TIDE_CHECK(static_cast<int>(call.ranks.size()) == N, "ExecuteGroupCuda: ", call.ranks.size(),
             " ranks for a group of ", N);
  std::vector<uintptr_t> streams;
  for (int r = 0; r < N; ++r) {
    const RankIo& io = *call.ranks[static_cast<size_t>(r)];
    TIDE_CHECK(io.device >= 0 && io.stream != nullptr, "rank ", r, ": no device or XLA stream");
    streams.push_back(reinterpret_cast<uintptr_t>(io.stream));
  }
  run_session(cuda_state(call), call, streams);
}

void CompleteRankCuda(const GroupCall& call, int rank) {
  if (call.spec.op != Collective::kAllGather) return;  // TIDE-RS wrote XLA's result in place
  const RankIo& io = *call.ranks.at(static_cast<size_t>(rank));
  GroupState& st = cuda_state(call);
  DeviceGuard guard;
  TIDE_CHECK_CUDA(cudaSetDevice(io.device), "device ", io.device);
  // The one copy of the XLA face: rank r's landing rows [0, D_p) -> XLA result p.
  const GroupLayout& lay = call.plan->layout;
  const int b_ag = dtype_size(call.plan->sig.ag_dtype);
  const char* ring = cuda_cluster_arena(st.session->executor(), rank) +
                     st.arena.offset[static_cast<int>(BufKind::kRing0)];
  std::vector<DeviceCopy> copies;
  for (int p = 0; p < lay.P; ++p) {
    const ParamLayout& pl = lay.params[p];
    copies.push_back({io.out[p], ring + pl.o * lay.N, static_cast<size_t>(pl.D * pl.K * b_ag)});
  }
  copy_async(copies, reinterpret_cast<uintptr_t>(io.stream));
}

}  // namespace tide::xla_ffi

#endif  // TIDE_WITH_CUDA
