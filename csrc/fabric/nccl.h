// NCCL fabric: one rank per process, arenas in an NCCL symmetric window, peers of the node's LSA
// team reached through their LSA pointers, a rail communicator per local index (paper §6).
//
// Contract
//   - NCCL is loaded at run time, never linked (nccl_api()): dlopen("libnccl.so.2", RTLD_NOLOAD)
//     first, so the framework's copy (torch loads it RTLD_GLOBAL) is reused, then a plain dlopen,
//     then the extra candidates (nccl_add_library_candidates: the nvidia.nccl wheel's lib/). The
//     loaded library's major.minor must equal the headers' (nccl_header_version()): the device
//     ABI (ncclWindow_vidmem, ncclDevComm) changed between 2.28 and 2.32.
//   - Construction is collective over the `world` ranks of `unique_id` (nccl_unique_id() of one
//     rank, passed to all): ncclCommInitRank; probe round 1 (versions, multicast gate, arena
//     bytes, gpus_per_node); ncclMemAlloc of the arena (zeroed, synchronised);
//     ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC); probe round 2 (LSA team size); the LSA
//     pointers; ncclCommSplit(color = local index, key = node) into the rail communicator.
//     Every rank must construct with the same (world, arena_bytes, gpus_per_node).
//   - Capability probe: each round all-reduces min and max of a small int64 vector on the
//     device; any field whose min != max makes EVERY rank throw the same PlanError naming the
//     field and both values (all ranks see the same reduced vectors, so none hangs in a later
//     collective). probe() is the agreed vector.
//   - arena(r): r's arena as mapped in this process, for r in this node's LSA team (the own rank
//     included: its LSA pointer aliases local_arena(), the ncclMemAlloc pointer); nullptr for
//     ranks outside the LSA team (executors refuse null arenas). is_local(r) only for the own
//     rank; device_of(r) is -1 for every other rank.
//   - Multicast: never created. multicast_allowed() (the gate of exec/cuda/runtime.h) only feeds
//     the probe; with the gate closed NCCL_NVLS_ENABLE is set to 0 when unset (so window
//     registration binds no multicast) and a non-zero NCCL_NVLS_ENABLE is refused.
//   - Teardown (close(), also run by the destructor, which logs instead of throwing): device
//     synchronise, window deregister, ncclMemFree, destroy the rail comm, then the comm. Window
//     deregistration is collective: every rank closes (tide_torch: after a barrier).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fabric/fabric.h"

namespace tide::fabric {

constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES

// The NCCL version the headers of this build declare (NCCL_VERSION_CODE), 0 without them.
int nccl_header_version();
// Extra library paths tried after the plain dlopen (the bindings add the wheel's lib/).
void nccl_add_library_candidates(const std::vector<std::string>& paths);
// The loaded library's ncclGetVersion (loads it; throws naming what is missing).
int nccl_version();
std::string nccl_library_path();
// ncclGetUniqueId: kNcclUniqueIdBytes bytes, to be passed to every rank's NcclFabric.
std::string nccl_unique_id();

class NcclFabric : public Fabric {
 public:
  // gpus_per_node: ranks per node (world % gpus_per_node == 0); local index = rank % it.
  NcclFabric(int rank, int world, int device, int64_t arena_bytes, const std::string& unique_id, int gpus_per_node);
  ~NcclFabric() override;
  NcclFabric(const NcclFabric&) = delete;
  NcclFabric& operator=(const NcclFabric&) = delete;

  int world() const override { return world_; }
  int device_of(int r) const override { return r == rank_ ? device_ : -1; }
  char* arena(int r) const override { return arena_.at(static_cast<size_t>(r)); }
  int64_t arena_bytes() const override { return arena_bytes_; }
  bool is_local(int r) const override { return r == rank_; }

  int rank() const { return rank_; }
  int device() const { return device_; }
  int gpus_per_node() const { return gpus_per_node_; }
  char* local_arena() const { return local_; }  // the ncclMemAlloc pointer
  int lsa_size() const { return lsa_size_; }
  int lsa_rank() const { return lsa_rank_; }
  int rail_size() const { return rail_size_; }
  int rail_rank() const { return rail_rank_; }
  // "put_signal" when the library exports ncclPutSignal and ncclWaitSignal (>= 2.29), else
  // "send_recv" (logged once per process).
  const std::string& rail_put_path() const { return rail_put_path_; }
  const std::vector<std::pair<std::string, int64_t>>& probe() const { return probe_; }
  bool closed() const { return comm_ == nullptr; }
  void close();

 private:
  void agree(const std::vector<std::pair<std::string, int64_t>>& fields);
  std::string release(bool orderly) noexcept;

  int rank_, world_, device_, gpus_per_node_;
  int64_t arena_bytes_;
  void* comm_ = nullptr;  // ncclComm_t
  void* rail_ = nullptr;  // ncclComm_t
  void* win_ = nullptr;   // ncclWindow_t
  char* local_ = nullptr;
  void* stream_ = nullptr;  // cudaStream_t of the probe all-reduces
  std::vector<char*> arena_;
  int lsa_size_ = 0, lsa_rank_ = -1, rail_size_ = 0, rail_rank_ = -1;
  std::string rail_put_path_;
  std::vector<std::pair<std::string, int64_t>> probe_;
};

// [Note: NCCL rail] The rail of one local index: the ranks of every node with that local index
// (rail rank = node), on a communicator of their own (ncclCommInitRankConfig over a unique id the
// face exchanges among them). Two-sided programs' rendezvous groups run on it
// ([Note: two-sided rails] in tide/program.h): one ncclGroupStart / ncclSend+ncclRecv per
// descriptor (bytes as ncclUint8) / ncclGroupEnd per group, enqueued on the executor's rail
// stream after its stream waits (no host sync). NCCL's SM use is bounded by the communicator's
// config (maxCTAs = max_ctas, nChannelsPerNetPeer = channels_per_peer). Construction is
// collective over the rail and pre-connects every rail peer (one 8-byte exchange each way).
// Fail-stop: abort() (ncclCommAbort) makes a stuck rail kernel exit; later enqueues throw.
struct RailXfer {
  int peer = -1;  // rail rank
  void* data = nullptr;
  int64_t bytes = 0;
};

class NcclRail {
 public:
  // timeout_s > 0: construction (the init among the rail's ranks, the pre-connect) has that
  // deadline, then aborts and throws TimeoutError ([Note: rail deadline] in nccl.cc); 0: it blocks.
  NcclRail(int rank, int size, int device, const std::string& unique_id, int max_ctas, int channels_per_peer,
           double timeout_s = 0);
  ~NcclRail();
  NcclRail(const NcclRail&) = delete;
  NcclRail& operator=(const NcclRail&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  int max_ctas() const { return max_ctas_; }
  int channels_per_peer() const { return channels_; }
  // One rendezvous group on `stream` (enqueue only). `what` names the group in errors.
  void enqueue(const std::vector<RailXfer>& sends, const std::vector<RailXfer>& recvs, void* stream,
               const std::string& what);
  std::string async_error();             // ncclCommGetAsyncError, "" when none
  void abort(const std::string& why);    // ncclCommAbort (thread-safe; once)
  const std::string& aborted() const { return aborted_; }
  void close();                          // ncclCommDestroy (every rail rank, after its last group)
  bool closed() const { return comm_ == nullptr; }
  // The host's share of enqueue(): groups enqueued, those whose ncclGroupEnd returned
  // ncclInProgress (a non-blocking rail: the caller's thread polled until NCCL had issued them),
  // and the seconds it polled in all.
  int64_t groups() const { return groups_.load(std::memory_order_relaxed); }
  int64_t in_progress_waits() const { return in_progress_.load(std::memory_order_relaxed); }
  double in_progress_wait_s() const {
    return 1e-9 * static_cast<double>(in_progress_ns_.load(std::memory_order_relaxed));
  }

 private:
  std::atomic<int64_t> groups_{0}, in_progress_{0}, in_progress_ns_{0};
  int rank_, size_, device_, max_ctas_, channels_;
  double timeout_s_ = 0;  // construction's deadline; 0: none ([Note: rail deadline])
  void* comm_ = nullptr;  // ncclComm_t
  std::string aborted_;
  std::mutex mu_;
};

namespace detail {
// nccl_lsa.cu: writes ncclGetLsaPointer(win, 0, p) for p in [0, n) into out[p] (device array)
// and the window's (lsaRank, worldRank) into ranks[0..1].
void launch_lsa_pointers(void* win, int n, void** out, int* ranks, void* stream);
}  // namespace detail

}  // namespace tide::fabric
