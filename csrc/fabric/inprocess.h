// In-process fabric: every rank of a virtual cluster lives in this process (paper §6; issue 4).
//
// Contract
//   - Each rank owns one arena (ArenaSpec::total bytes, plain cudaMalloc on the rank's device,
//     zeroed at creation so every counter starts at epoch 0). Peers are addressed by plain device
//     pointers: arena(r) is valid on every device that has peer access to r's device.
//   - Ranks may share one GPU (the virtual cluster on the test machine) or spread over several
//     GPUs of this process; peer access is enabled between every pair of devices used.
//   - No multicast object is ever created here; the fabric reports multicast = false.
//   - Lifetime: the fabric frees the arenas in its destructor after synchronising the devices;
//     executors hold it through std::shared_ptr so it outlives every stream that uses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tide::fabric {

class InProcessFabric {
 public:
  // rank_device[r]: the CUDA device of rank r (all 0 on a one-GPU virtual cluster).
  InProcessFabric(std::vector<int> rank_device, int64_t arena_bytes);
  ~InProcessFabric();
  InProcessFabric(const InProcessFabric&) = delete;
  InProcessFabric& operator=(const InProcessFabric&) = delete;

  int world() const { return static_cast<int>(arena_.size()); }
  int device_of(int rank) const { return rank_device_[static_cast<size_t>(rank)]; }
  char* arena(int rank) const { return arena_[static_cast<size_t>(rank)]; }
  int64_t arena_bytes() const { return arena_bytes_; }
  bool multicast() const { return false; }
  // Host mirror of the value last *issued* to each counter of `rank` (not yet necessarily
  // written). Counters have a single producing stream, so "counter += v" is issued as a write of
  // issued + v. It lives with the arena because every executor over this arena shares counters.
  std::vector<uint64_t>& issued(int rank, size_t num_counters) {
    auto& v = issued_[static_cast<size_t>(rank)];
    if (v.size() < num_counters) v.resize(num_counters, 0);
    return v;
  }

 private:
  std::vector<int> rank_device_;
  std::vector<char*> arena_;
  int64_t arena_bytes_;
  std::vector<std::vector<uint64_t>> issued_;
};

}  // namespace tide::fabric
