// CUDA-IPC fabric (contract in ipc.h).
#include "fabric/ipc.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "tide/errors.h"

namespace tide::fabric {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "cudaIpcMemHandle_t is 64 bytes");

IpcFabric::IpcFabric(int rank, int world, int device, int64_t arena_bytes)
    : rank_(rank), world_(world), device_(device), arena_bytes_(arena_bytes) {
  TIDE_PLAN_CHECK(world >= 1, "CudaIpcFabric: world must be >= 1, got ", world);
  TIDE_PLAN_CHECK(rank >= 0 && rank < world, "CudaIpcFabric: rank ", rank, " is outside [0, ", world, ")");
  TIDE_PLAN_CHECK(arena_bytes > 0, "CudaIpcFabric: arena_bytes must be positive, got ", arena_bytes);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  TIDE_PLAN_CHECK(device >= 0 && device < n, "CudaIpcFabric: device ", device, " is not a usable CUDA device (",
                  n, " visible)");
  arena_.assign(static_cast<size_t>(world), nullptr);
  check_device_room(device_, 1, arena_bytes_, "CudaIpcFabric");
  TIDE_CHECK_CUDA(cudaSetDevice(device_), "device ", device_);
  void* p = nullptr;
  TIDE_CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(arena_bytes_)), "arena of rank ", rank_, " (", arena_bytes_,
                  " bytes)");
  arena_[static_cast<size_t>(rank_)] = static_cast<char*>(p);
  try {
    TIDE_CHECK_CUDA(cudaMemset(p, 0, static_cast<size_t>(arena_bytes_)), "zeroing arena of rank ", rank_);
    TIDE_CHECK_CUDA(cudaDeviceSynchronize(), "arena zeroing");
    cudaIpcMemHandle_t h{};
    TIDE_CHECK_CUDA(cudaIpcGetMemHandle(&h, p), "exporting rank ", rank_, "'s arena");
    handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  } catch (...) {
    cudaFree(p);
    arena_[static_cast<size_t>(rank_)] = nullptr;
    throw;
  }
}

IpcFabric::~IpcFabric() { close_all(); }

void IpcFabric::close_all() noexcept {
  cudaSetDevice(device_);
  cudaDeviceSynchronize();  // no stream of this process may still touch an arena
  for (int r = 0; r < world_; ++r) {
    char*& a = arena_[static_cast<size_t>(r)];
    if (!a) continue;
    if (r == rank_) cudaFree(a);
    else cudaIpcCloseMemHandle(a);
    a = nullptr;
  }
}

std::string IpcFabric::handle() const { return handle_; }

void IpcFabric::open_peers(const std::vector<std::string>& handles) {
  TIDE_PLAN_CHECK(!opened_, "CudaIpcFabric.open_peers: rank ", rank_, "'s peers are already open");
  TIDE_PLAN_CHECK(static_cast<int>(handles.size()) == world_, "CudaIpcFabric.open_peers: ", handles.size(),
                  " handles for ", world_, " ranks");
  for (int r = 0; r < world_; ++r)
    TIDE_PLAN_CHECK(r == rank_ || handles[static_cast<size_t>(r)].empty() ||
                        handles[static_cast<size_t>(r)].size() == kIpcHandleBytes,
                    "CudaIpcFabric.open_peers: handles[", r, "] has ", handles[static_cast<size_t>(r)].size(),
                    " bytes, a CUDA IPC handle has ", kIpcHandleBytes);
  TIDE_CHECK_CUDA(cudaSetDevice(device_), "device ", device_);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;  // a process cannot open its own handle; arena(rank) is the base
    if (handles[static_cast<size_t>(r)].empty()) continue;  // host isolation: another node's, never mapped
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, handles[static_cast<size_t>(r)].data(), sizeof(h));
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      for (int q = 0; q < r; ++q) {
        char*& a = arena_[static_cast<size_t>(q)];
        if (q != rank_ && a) {
          cudaIpcCloseMemHandle(a);
          a = nullptr;
        }
      }
      throw Error(TIDE_STR_CAT("CudaIpcFabric: rank ", rank_, " (device ", device_, ") cannot open rank ", r,
                               "'s arena handle: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
    }
    arena_[static_cast<size_t>(r)] = static_cast<char*>(p);
  }
  opened_ = true;
}

}  // namespace tide::fabric
