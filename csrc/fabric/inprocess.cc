// In-process fabric (contract in inprocess.h).
#include "fabric/inprocess.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <set>

#include "tide/errors.h"

namespace tide::fabric {

void check_device_room(int device, int ranks, int64_t arena_bytes, const char* who, const std::string& largest) {
  size_t free_b = 0, total_b = 0;
  TIDE_CHECK_CUDA(cudaSetDevice(device), who, ": device ", device);
  TIDE_CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b), who, ": free memory of device ", device);
  const double need = static_cast<double>(ranks) * static_cast<double>(arena_bytes);
  TIDE_PLAN_CHECK(need <= static_cast<double>(free_b), who, ": ", ranks, " rank(s) x ", arena_bytes,
                  " arena bytes on device ", device, " exceed the ", free_b, " bytes free there (of ", total_b, "); ",
                  largest.empty() ? "the plan's regions (Options.n_stg, chunk_bytes, mode) or the ranks per device make "
                                    "it large" : largest);
}

InProcessFabric::InProcessFabric(std::vector<int> rank_device, int64_t arena_bytes)
    : rank_device_(std::move(rank_device)), arena_bytes_(arena_bytes) {
  TIDE_PLAN_CHECK(!rank_device_.empty(), "InProcessFabric: at least one rank");
  TIDE_PLAN_CHECK(arena_bytes_ > 0, "InProcessFabric: arena_bytes must be positive");
  const std::set<int> devices(rank_device_.begin(), rank_device_.end());
  for (int a : devices) {
    TIDE_CHECK_CUDA(cudaSetDevice(a), "device ", a);
    for (int b : devices) {
      if (a == b) continue;
      int ok = 0;
      TIDE_CHECK_CUDA(cudaDeviceCanAccessPeer(&ok, a, b));
      TIDE_PLAN_CHECK(ok, "InProcessFabric: device ", a, " cannot access device ", b);
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else {
        TIDE_CHECK_CUDA(e, "enabling peer access ", a, " -> ", b);
      }
    }
  }
  for (int d : devices)
    check_device_room(d, static_cast<int>(std::count(rank_device_.begin(), rank_device_.end(), d)), arena_bytes_,
                      "InProcessFabric");
  arena_.assign(rank_device_.size(), nullptr);
  try {
    for (size_t r = 0; r < rank_device_.size(); ++r) {
      TIDE_CHECK_CUDA(cudaSetDevice(rank_device_[r]));
      void* p = nullptr;
      // 256-byte aligned by cudaMalloc; region offsets are 4 KiB aligned by the arena spec.
      TIDE_CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(arena_bytes_)), "arena of rank ", r, " (",
                      arena_bytes_, " bytes)");
      arena_[r] = static_cast<char*>(p);
      TIDE_CHECK_CUDA(cudaMemset(p, 0, static_cast<size_t>(arena_bytes_)), "zeroing arena of rank ", r);
    }
    TIDE_CHECK_CUDA(cudaDeviceSynchronize(), "arena zeroing");
  } catch (...) {
    for (size_t r = 0; r < arena_.size(); ++r)
      if (arena_[r]) {
        cudaSetDevice(rank_device_[r]);
        cudaFree(arena_[r]);
      }
    throw;
  }
}

InProcessFabric::~InProcessFabric() {
  for (size_t r = 0; r < arena_.size(); ++r) {
    cudaSetDevice(rank_device_[r]);
    cudaDeviceSynchronize();  // no stream may still touch the arena
    cudaFree(arena_[r]);
  }
}

}  // namespace tide::fabric
