// CUDA-IPC fabric: one rank per process (tide_torch under torchrun) or several (one JAX process
// per host), peers in other processes of the node, on other GPUs or on the SAME GPU (paper §6).
//
// Contract
//   - This process's rank allocates its arena with cudaMalloc on `device` (zeroed, so counters
//     start at epoch 0) and exports it as a 64-byte cudaIpcMemHandle (handle()). Exchanging the
//     handles is the caller's job (tide_torch: an all_gather of bytes; tests: a pipe).
//   - open_peers(handles, same_process): handles[r] for every rank (the own entry is ignored; an
//     empty one: a rank of another node, never mapped, reached only by the rail); each peer's
//     arena is opened with cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess), which
//     works for a peer on another GPU of the node and for another process on the same GPU. Until
//     then arena(peer) is null and executors refuse to run.
//   - [Note: same-process peers] A rank of this process (a process holding several ranks of its
//     node: one JAX process per host) is given in same_process[r] instead: CUDA refuses
//     cudaIpcOpenMemHandle on a handle of the own process, so its arena is taken by pointer (peer
//     access enabled when it is on another device; same GPU: the pointer as it is). Such a peer
//     stays a peer: is_local(r) and device_of(r) answer as for another process's rank (this
//     fabric's executor issues only its own rank's ops, with the same counters and paths as over
//     IPC), so the bytes equal the IPC path's. The caller keeps those fabrics alive as long as
//     this one is used (CudaProcessRank: the executor holds them); they are never closed here.
//     The fabrics of one process's ranks share an IssueBoard (issue_board(); [Note: same-process
//     issue gate] in fabric.h): their executors enqueue in one order.
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
  // same_process[r]: rank r's fabric when it lives in this process (else null; empty: none).
  void open_peers(const std::vector<std::string>& handles, const std::vector<const IpcFabric*>& same_process = {});

 private:
  void close_all() noexcept;
  void borrow(int r, const IpcFabric& peer);
  int rank_;
  int world_;
  int device_;
  int64_t arena_bytes_;
  std::vector<char*> arena_;  // own: cudaMalloc; peers: cudaIpcOpenMemHandle (or borrowed_)
  std::vector<bool> borrowed_;  // same-process peers' arenas: never closed here
  std::string handle_;
  bool opened_ = false;
};

}  // namespace tide::fabric
