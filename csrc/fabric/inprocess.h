// In-process fabric: every rank of a virtual cluster lives in this process (paper §6).
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

#include "fabric/fabric.h"

namespace tide::fabric {

class InProcessFabric : public Fabric {
 public:
  // rank_device[r]: the CUDA device of rank r (all 0 on a one-GPU virtual cluster).
  InProcessFabric(std::vector<int> rank_device, int64_t arena_bytes);
  ~InProcessFabric() override;
  InProcessFabric(const InProcessFabric&) = delete;
  InProcessFabric& operator=(const InProcessFabric&) = delete;

  int world() const override { return static_cast<int>(arena_.size()); }
  int device_of(int rank) const override { return rank_device_[static_cast<size_t>(rank)]; }
  char* arena(int rank) const override { return arena_[static_cast<size_t>(rank)]; }
  int64_t arena_bytes() const override { return arena_bytes_; }
  bool is_local(int) const override { return true; }
  // issued(): lives with the arena because every executor over this arena shares counters.

 private:
  std::vector<int> rank_device_;
  std::vector<char*> arena_;
  int64_t arena_bytes_;
};

}  // namespace tide::fabric
