// CUDA-IPC fabric: one rank per process (tide_torch under torchrun), peers in other processes of
// the node, on other GPUs or on the SAME GPU (paper §6).
//
// Contract
//   - This process's rank allocates its arena with cudaMalloc on `device` (zeroed, so counters
//     start at epoch 0) and exports it as a 64-byte cudaIpcMemHandle (handle()). Exchanging the
//     handles is the caller's job (tide_torch: an all_gather of bytes; tests: a pipe).
//   - open_peers(handles): handles[r] for every rank (the own entry is ignored; an empty one: a
//     rank of another node, never mapped, reached only by the rail); each peer's
//     arena is opened with cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess), which
//     works for a peer on another GPU of the node and for another process on the same GPU. Until
//     then arena(peer) is null and executors refuse to run.
//   - Lifetime: the destructor synchronises the device, closes the peers' mappings, then frees
//     the own arena. A peer must keep its arena alive until every process that opened it has
//     finished using it (tide_torch: a barrier before teardown).
//   - No multicast object is ever created; multicast() is false.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fabric/fabric.h"

namespace tide::fabric {

constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

class IpcFabric : public Fabric {
 public:
  IpcFabric(int rank, int world, int device, int64_t arena_bytes);
  ~IpcFabric() override;
  IpcFabric(const IpcFabric&) = delete;
  IpcFabric& operator=(const IpcFabric&) = delete;

  int world() const override { return world_; }
  int rank() const { return rank_; }
  int device() const { return device_; }
  int device_of(int r) const override { return r == rank_ ? device_ : -1; }
  char* arena(int r) const override { return arena_.at(static_cast<size_t>(r)); }
  int64_t arena_bytes() const override { return arena_bytes_; }
  bool is_local(int r) const override { return r == rank_; }
  bool peers_open() const { return opened_; }

  std::string handle() const;  // this rank's IPC handle (kIpcHandleBytes bytes)
  void open_peers(const std::vector<std::string>& handles);

 private:
  void close_all() noexcept;
  int rank_;
  int world_;
  int device_;
  int64_t arena_bytes_;
  std::vector<char*> arena_;  // own: cudaMalloc; peers: cudaIpcOpenMemHandle
  std::string handle_;
  bool opened_ = false;
};

}  // namespace tide::fabric
