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
//   - issue_board(): the IssueBoard this fabric shares with the fabrics of the other ranks of
//     this process (IpcFabric with same-process peers), null otherwise ([Note: same-process issue
//     gate] below).
//   - No fabric ever creates a multicast object: multicast() is false.
//
// [Note: same-process issue gate]
// [Note: enqueue order] (exec/cuda/issue.h) proves progress for any mapping of streams onto
// hardware queues when each process enqueues a restriction of one global topological order. A
// process that holds several ranks, each with its own rank executor called from its own thread
// (one JAX process per host; tests/test_cuda_host_processes.py), enqueues an interleaving of
// several restrictions instead, which is not one: rank a's wait on rank b's counter (the RS
// ready_from waits, the entry fence) can reach a hardware queue that b's stream shares ahead of
// b's producer, or of an op that producer needs, and the queue never moves (streams share
// queues once a process has more than CUDA_DEVICE_MAX_CONNECTIONS of them: every rank's internal
// streams and copy lanes, the callers' streams, NCCL's). So the fabrics of such ranks share one
// IssueBoard, and a call's
// ranks of this process whose executors joined it take turns in the global order: each rank
// walks the whole order anyway (it simulates its peers), so it counts its peers' steps and
// issues its own step at position p only once the board shows the p steps before it issued
// (IssueTurns); a rank hands its turn on only after enqueueing what its steps left pending (the
// issue path's batched waits and counter writes). A call's entry (the caller's event, the fence
// write) is a step of each rank, and
// its fence waits a later one: every entry of the call before any fence wait. Positions count on
// across calls (a lane per set of ranks), so a rank's next call waits until its peers issued the
// call before. Turns only order the host's enqueueing; a rank whose turn does not come within the
// executor's deadline fails with TimeoutError naming the rank it waited for (fail-stop). Ranks of
// one process that run different calls (sub-groups) are ordered only within the calls they share;
// an executor with ExecutorOptions::graphs (calls launched whole as graphs) takes no turns.
// ExecutorOptions::issue_gate (default on) turns the gate off, for diagnosis.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace tide::fabric {

class IssueBoard;

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
  const std::shared_ptr<IssueBoard>& issue_board() const { return board_; }

 protected:
  void set_issue_board(std::shared_ptr<IssueBoard> b) { board_ = std::move(b); }

 private:
  std::vector<std::vector<uint64_t>> issued_;
  std::shared_ptr<IssueBoard> board_;
};

// The turns of one process's ranks ([Note: same-process issue gate]). Thread-safe.
class IssueBoard {
 public:
  // The board of this process's ranks `ranks` (fabric rank, arena address): every fabric that
  // names the same ranks and arenas gets the same board (a process-wide table, weakly held).
  static std::shared_ptr<IssueBoard> shared(std::vector<std::pair<int, const void*>> ranks);
  // An executor of `rank` takes turns from now on / no longer (its lanes are dropped).
  void join(int rank);
  void leave(int rank);
  // The joined ranks among `members` (a call's fabric ranks), ascending.
  std::vector<int> joined_among(const std::vector<int>& members) const;

 private:
  friend class IssueTurns;
  struct Lane {
    int64_t done = 0;               // steps of this lane's calls issued, in the global order
    std::map<int, int64_t> next;    // rank -> its next call's first position
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> joined_;
  std::map<std::vector<int>, std::shared_ptr<Lane>> lanes_;  // by the calls' ranks
};

// One call of rank `me` on a board: the positions of the call's steps of `ranks` (the call's
// joined ranks of this process, `me` among them, IssueBoard::joined_among) in the global order.
// The caller visits every step of those ranks in that order: own() before enqueueing one of its
// own, peer(flush) for one of another rank, finish(flush) after the last; flush enqueues what the
// own steps left pending (batched stream memory operations), so a step is published only once it
// is enqueued. Not thread-safe (one per call and thread).
class IssueTurns {
 public:
  IssueTurns(IssueBoard& board, std::vector<int> ranks, int me, double deadline_s, std::string what);
  bool involves(int rank) const;
  const std::vector<int>& ranks() const { return ranks_; }
  void own();  // returns when every earlier step is issued; TimeoutError past the deadline
  template <class Flush>
  void peer(int rank, Flush&& flush) {
    if (held_) {
      flush();
      publish();
    }
    owner_.push_back(rank);
    ++pos_;
  }
  template <class Flush>
  void finish(Flush&& flush) {
    if (held_) {
      flush();
      publish();
    }
    save();
  }
  int64_t position() const { return pos_; }

 private:
  void publish();  // the held positions are issued
  void save();     // the next call of this lane starts at pos_
  IssueBoard& board_;
  std::shared_ptr<IssueBoard::Lane> lane_;
  std::vector<int> ranks_;
  int me_;
  double deadline_s_;
  std::string what_;
  int64_t start_ = 0, pos_ = 0;
  bool held_ = false;         // positions since the last publish are the own rank's
  std::vector<int> owner_;    // the owner of each position from start_
};

// PlanError when `bytes` more device memory than `device` has free is asked for (before the
// cudaMalloc that would fail, or succeed and starve the framework): names `who`, the ranks and
// the free and total bytes, and `largest` (a face that knows the arena's regions names the
// largest one; the fabrics, which do not, check again with a general hint).
void check_device_room(int device, int ranks, int64_t arena_bytes, const char* who, const std::string& largest = "");

}  // namespace tide::fabric
