// The CUDA side of the core as ffi/ and other faces see it: no CUDA or private executor headers.
//
// Contract
//   - make_cuda_cluster_executor(): every rank of a group in this process, rank r on device
//     rank_devices[r], each with a zeroed arena of `arena_bytes` (an in-process fabric), as a
//     CallExecutor for GroupSession (tide/session.h). Its run() takes one caller stream per rank
//     (cudaStream_t as uintptr_t): the call's streams wait for the caller's prior work and every
//     caller stream waits for the whole call (no host synchronisation).
//   - copy_async(): device-to-device copies on a stream through the executors' copy path.
//   - CudaProcessRank: one rank of a job whose ranks live in processes (one per GPU, several
//     processes sharing a GPU, or one process holding several ranks of its node), for faces that
//     have no Python fabric objects (ffi/): its CUDA-IPC arena, the arenas of its topology node's
//     peers (by IPC, or by pointer in this process), its NCCL rail to the other nodes, and its
//     CUDA rank executor over them.
//   - multicast_allowed() and DeviceGuard: what the fabrics (csrc/fabric) share with the
//     executors; the executors' own headers (csrc/exec/cuda) stay private to them.
//   - Only in a build with CUDA (TIDE_WITH_CUDA); callers guard with that macro.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tide/exec_cpu.h"
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

// Rank `rank` of topology `topo`, held by this process on `device`, its peers in other processes.
// Construction allocates the zeroed CUDA-IPC arena of `arena_bytes` (refused above the device's
// free memory); ipc_handle() is what its node's peers open. connect() opens the arenas of the
// ranks of its topology node (handles[q] for every rank q; other nodes' entries are ignored:
// they are reached only through the rail) and, when topo.nodes > 1, joins the NCCL rail of its
// local index (rail_id: ncclGetUniqueId of that rail's node-0 rank; collective over the rail's
// ranks, one per node, in every process in the same order), and returns its CudaRankExecutor as
// a CallExecutor over `regions` (two-sided rails when topo.nodes > 1: [Note: two-sided rails]).
// The arena and the rail live as long as this object or the executor, whichever is last.
constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

class CudaProcessRank {
 public:
  CudaProcessRank(int rank, const Topology& topo, int device, int64_t arena_bytes);
  std::string ipc_handle() const;
  char* arena() const;  // this rank's arena (device pointer)
  int device() const;
  // same_process: this process's other ranks of the group (a process holding several ranks of its
  // node: their arenas by pointer, [Note: same-process peers] in fabric/ipc.h; the executor keeps
  // them alive). A rank of another topology node in this process is refused by name: a node is a
  // host, and the rail between the two would have both ends in this process.
  std::shared_ptr<CallExecutor> connect(const std::vector<std::string>& handles, const std::string& rail_id,
                                        const RegionTable& regions, ExecutorOptions opt,
                                        const std::vector<const CudaProcessRank*>& same_process = {});
  // How a rank of `topo` reaches other nodes: two-sided rails when there are any (what connect()
  // sets, and what the arena's counters must be sized for).
  static Rails rails_for(const Topology& topo) { return topo.nodes > 1 ? Rails::kTwoSided : Rails::kOneSided; }

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// ncclGetUniqueId for a rail (NCCL is loaded at first use: fabric/nccl.h); throws naming what is
// missing in a build without NCCL headers.
std::string nccl_rail_unique_id();
// Extra libnccl.so.2 paths tried after the framework's copy and the loader's path (the
// nvidia.nccl wheel's lib/, which the face knows).
void nccl_library_candidates(const std::vector<std::string>& paths);

}  // namespace tide

namespace tide::cuda {

// The multicast gate (docs/multicast.md): true only when TIDE_ENABLE_MULTICAST=1 AND the
// driver reports MULTICAST_SUPPORTED AND NCCL_NVLS_ENABLE != 0 (and set) AND
// TORCH_SYMM_MEM_DISABLE_MULTICAST is unset. Querying the attribute is safe.
bool multicast_allowed(int device);
// NCCL_NVLS_ENABLE as the process had it when TIDE first looked (nullptr: unset); the multicast
// gate and the NCCL layer's NVLS guard share this one read.
const char* nccl_nvls_setting();

// Usable CUDA devices (cudaGetDeviceCount; 0 without a driver or a device, the error cleared).
int device_count();

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
