// The CPU executors' rail transport: two-sided send/recv between nodes ([Note: two-sided rails]
// in tide/program.h). The CUDA executors' twin is NCCL on the rail communicator (exec/cuda).
//
// Contract
//   - start() posts one rendezvous group of `rank` (a program's consecutive SEND/RECV ops with one
//     rail_group) and returns at once. Its sends and receives progress together (NCCL group
//     semantics); the k-th send from rank a to rank b meets b's k-th receive from a, and their byte
//     counts must be equal (a mismatch fails both groups, naming ranks and bytes). A send's source
//     may be rewritten, and a receive's bytes read, once test() returned true.
//   - test() polls; it throws tide::Error when the transport failed (a size mismatch, a peer
//     that went away, an aborted rail), naming the ranks. The executor's deadline bounds the
//     polling (fail-stop: a group that does not complete in time aborts the rail, and the
//     executor raises TimeoutError naming rank, op and call sequence).
//   - Peers are the executor's ranks (global ranks of the job); one Rail serves every rank of its
//     process. Implementations: LocalRail (make_local_rail: every rank in this process, the CPU
//     virtual cluster's two-sided mode) and the faces' framework rails (tide_torch: torch.distributed
//     send/recv on the gloo process group), bound through the Python module.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tide {

struct RailTransfer {
  int peer = -1;        // the other end (executor rank)
  void* data = nullptr; // send: the source bytes; recv: where they land
  int64_t bytes = 0;
};

class Rail {
 public:
  virtual ~Rail() = default;
  virtual uint64_t start(int rank, const std::vector<RailTransfer>& sends, const std::vector<RailTransfer>& recvs) = 0;
  virtual bool test(uint64_t ticket) = 0;
  virtual void abort(const std::string& why) = 0;  // every pending and later group fails with `why`
  virtual std::string name() const = 0;
};

// Every rank of this process: a send meets its receive in memory (a memcpy once both are posted).
std::shared_ptr<Rail> make_local_rail();

}  // namespace tide
