// The fabric interface the CUDA executors use: where every rank's arena is, which ranks this
// process issues, and the host mirror of the counters this process produces (paper §6).
//
// Contract
//   - arena(r) is a device pointer valid in this process (and on every device that has peer
//     access to r's): a plain cudaMalloc (in-process) or an opened CUDA IPC handle (peers of
//     another process). Arenas are zeroed at creation, so every counter starts at epoch 0.
//   - is_local(r): r's arena was allocated by this process (its ops may be issued here).
//     device_of(r) is known for local ranks; -1 for a peer of another process.
//   - issued(r, n): the host mirror of the value last *issued* to each counter of rank r's arena
//     by this process. Counters have a single producing (rank, stream), so "counter += v" is
//     issued as a write of issued + v by the one process that owns the producer; rank executors
//     also keep their simulation of peers' counters here (exec/cuda/issue.h, [Note: enqueue order]).
//   - No fabric ever creates a multicast object: multicast() is false.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tide::fabric {

class Fabric {
 public:
  virtual ~Fabric() = default;
  virtual int world() const = 0;
  virtual int device_of(int rank) const = 0;
  virtual char* arena(int rank) const = 0;
  virtual int64_t arena_bytes() const = 0;
  virtual bool is_local(int rank) const = 0;
  bool multicast() const { return false; }
  std::vector<uint64_t>& issued(int rank, size_t num_counters) {
    if (issued_.size() < static_cast<size_t>(world())) issued_.resize(static_cast<size_t>(world()));
    auto& v = issued_[static_cast<size_t>(rank)];
    if (v.size() < num_counters) v.resize(num_counters, 0);
    return v;
  }

 private:
  std::vector<std::vector<uint64_t>> issued_;
};

// PlanError when `bytes` more device memory than `device` has free is asked for (before the
// cudaMalloc that would fail, or succeed and starve the framework): names `who`, the ranks and
// the free and total bytes, and `largest` (a face that knows the arena's regions names the
// largest one; the fabrics, which do not, check again with a general hint).
void check_device_room(int device, int ranks, int64_t arena_bytes, const char* who, const std::string& largest = "");

}  // namespace tide::fabric
