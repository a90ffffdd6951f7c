// The CUDA side of the core as ffi/ and other faces see it: no CUDA or private executor headers.
//
// Contract
//   - make_cuda_cluster_executor(): every rank of a group in this process, rank r on device
//     rank_devices[r], each with a zeroed arena of `arena_bytes` (an in-process fabric), as a
//     CallExecutor for GroupSession (tide/session.h). Its run() takes one caller stream per rank
//     (cudaStream_t as uintptr_t): the call's streams wait for the caller's prior work and every
//     caller stream waits for the whole call (no host synchronisation).
//   - copy_async(): device-to-device copies on a stream through the executors' copy path.
//   - multicast_allowed() and DeviceGuard: what the fabrics (csrc/fabric) share with the
//     executors; the executors' own headers (csrc/exec/cuda) stay private to them.
//   - Only in a build with CUDA (TIDE_WITH_CUDA); callers guard with that macro.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "tide/exec_options.h"
#include "tide/session.h"

namespace tide {

std::shared_ptr<CallExecutor> make_cuda_cluster_executor(const std::vector<int>& rank_devices, int64_t arena_bytes,
                                                         const ExecutorOptions& opt);
// Rank r's arena base (device pointer) of an executor made above; throws for other executors.
char* cuda_cluster_arena(const CallExecutor& ex, int rank);

struct DeviceCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};
void copy_async(const std::vector<DeviceCopy>& copies, uintptr_t stream);

}  // namespace tide

namespace tide::cuda {

// The multicast gate (ARCHITECTURE.md, Safety): true only when TIDE_ENABLE_MULTICAST=1 AND the
// driver reports MULTICAST_SUPPORTED AND NCCL_NVLS_ENABLE != 0 (and set) AND
// TORCH_SYMM_MEM_DISABLE_MULTICAST is unset. Querying the attribute is safe.
bool multicast_allowed(int device);
// NCCL_NVLS_ENABLE as the process had it when TIDE first looked (nullptr: unset); the multicast
// gate and the NCCL layer's NVLS guard share this one read.
const char* nccl_nvls_setting();

// Sets `device` for a scope and restores the caller's current device on exit (torch and JAX keep
// their own notion of it). `who` prefixes the error when the device cannot be set.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device, const char* who = "");
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace tide::cuda
