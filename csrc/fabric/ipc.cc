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
  borrowed_.assign(static_cast<size_t>(world), false);
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
    else if (!borrowed_[static_cast<size_t>(r)]) cudaIpcCloseMemHandle(a);
    a = nullptr;
  }
}

std::string IpcFabric::handle() const { return handle_; }

// A same-process peer's arena by pointer ([Note: same-process peers] in ipc.h).
void IpcFabric::borrow(int r, const IpcFabric& peer) {
  TIDE_PLAN_CHECK(peer.world_ == world_ && peer.rank_ == r && peer.arena_bytes_ == arena_bytes_,
                  "CudaIpcFabric.open_peers: same_process[", r, "] is rank ", peer.rank_, " of ", peer.world_, " with ",
                  peer.arena_bytes_, "-byte arenas, expected rank ", r, " of ", world_, " with ", arena_bytes_);
  if (peer.device_ != device_) {
    int ok = 0;
    TIDE_CHECK_CUDA(cudaDeviceCanAccessPeer(&ok, device_, peer.device_));
    TIDE_PLAN_CHECK(ok, "CudaIpcFabric: rank ", rank_, " (device ", device_, ") cannot access device ", peer.device_,
                    " of rank ", r, " (same process, no peer access)");
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer.device_, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else {
      TIDE_CHECK_CUDA(e, "enabling peer access ", device_, " -> ", peer.device_);
    }
  }
  arena_[static_cast<size_t>(r)] = peer.arena_[static_cast<size_t>(r)];
  borrowed_[static_cast<size_t>(r)] = true;
}

void IpcFabric::open_peers(const std::vector<std::string>& handles, const std::vector<const IpcFabric*>& same_process) {
  TIDE_PLAN_CHECK(!opened_, "CudaIpcFabric.open_peers: rank ", rank_, "'s peers are already open");
  TIDE_PLAN_CHECK(static_cast<int>(handles.size()) == world_, "CudaIpcFabric.open_peers: ", handles.size(),
                  " handles for ", world_, " ranks");
  TIDE_PLAN_CHECK(same_process.empty() || static_cast<int>(same_process.size()) == world_,
                  "CudaIpcFabric.open_peers: same_process has ", same_process.size(), " entries for ", world_, " ranks");
  auto in_process = [&](int r) { return !same_process.empty() && same_process[static_cast<size_t>(r)] != nullptr; };
  for (int r = 0; r < world_; ++r)
    TIDE_PLAN_CHECK(r == rank_ || in_process(r) || handles[static_cast<size_t>(r)].empty() ||
                        handles[static_cast<size_t>(r)].size() == kIpcHandleBytes,
                    "CudaIpcFabric.open_peers: handles[", r, "] has ", handles[static_cast<size_t>(r)].size(),
                    " bytes, a CUDA IPC handle has ", kIpcHandleBytes);
  TIDE_CHECK_CUDA(cudaSetDevice(device_), "device ", device_);
  try {
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;  // a process cannot open its own handle; arena(rank) is the base
      if (in_process(r)) {
        borrow(r, *same_process[static_cast<size_t>(r)]);
        continue;
      }
      if (handles[static_cast<size_t>(r)].empty()) continue;  // host isolation: another node's, never mapped
      cudaIpcMemHandle_t h{};
      std::memcpy(&h, handles[static_cast<size_t>(r)].data(), sizeof(h));
      void* p = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();
        throw Error(TIDE_STR_CAT("CudaIpcFabric: rank ", rank_, " (device ", device_, ") cannot open rank ", r,
                                 "'s arena handle: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
      }
      arena_[static_cast<size_t>(r)] = static_cast<char*>(p);
    }
  } catch (...) {
    for (int q = 0; q < world_; ++q) {  // what was opened so far; the own arena stays
      char*& a = arena_[static_cast<size_t>(q)];
      if (q != rank_ && a && !borrowed_[static_cast<size_t>(q)]) cudaIpcCloseMemHandle(a);
      if (q != rank_) {
        a = nullptr;
        borrowed_[static_cast<size_t>(q)] = false;
      }
    }
    throw;
  }
  // [Note: same-process issue gate] (fabric.h): this process's ranks share one board.
  std::vector<std::pair<int, const void*>> here{{rank_, arena_[static_cast<size_t>(rank_)]}};
  for (int r = 0; r < world_; ++r)
    if (r != rank_ && in_process(r)) here.emplace_back(r, arena_[static_cast<size_t>(r)]);
  if (here.size() > 1) set_issue_board(IssueBoard::shared(std::move(here)));
  opened_ = true;
}

}  // namespace tide::fabric
