// TIDE CUDA runtime pieces under the executor: driver entry points, stream memory operations
// (signals, credits, waits), copy paths and the host watchdog.
//
// Contract
//   - libcuda is never linked: driver functions are resolved once through
//     cudaGetDriverEntryPointByVersion (cudart is static), so tide._core imports with no driver.
//   - Counters are 64-bit device words that only grow (monotonically increasing epochs); a
//     SIGNAL writes an epoch, a WAIT blocks a stream until counter >= epoch (GEQ). No reset.
//   - Every CUDA/driver return code is checked and turned into tide::Error; an overdue wait is
//     turned into tide::TimeoutError naming rank, op and sequence (fail-stop, never a hang).
//   - Multicast is never touched here. multicast_allowed() only evaluates the safety gate.
#pragma once

#include <cuda.h>  // types only; no libcuda link
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tide/cuda.h"
#include "tide/exec_options.h"

namespace tide::cuda {

// ---- driver entry points ---------------------------------------------------------------------
struct DriverApi {
  CUresult (*stream_write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*stream_wait_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*stream_batch_mem_op)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
};
const DriverApi& driver();  // resolved on first use; throws tide::Error when unavailable
void check_cu(CUresult r, const char* what);

// multicast_allowed(device): the multicast gate, declared in tide/cuda.h.

// ---- signals, credits, waits (stream memory operations) -------------------------------------
struct WaitSpec {
  const uint64_t* counter;  // device address (this GPU's or a peer's)
  uint64_t value;           // wait until *counter >= value
  int32_t label = -1;       // the issuer's name for this wait (WaitLabels), -1: none
};
// Writes `value` to `counter` after all prior work on `stream` (the default write flag orders it
// after prior memory operations, like __threadfence_system).
void signal(cudaStream_t stream, uint64_t* counter, uint64_t value);
// Several such writes as WRITE_VALUE_64 operations of one cuStreamBatchMemOp (split in batches of
// 255), which enqueues them in array order: each is ordered after all prior work on `stream`, as
// the same writes issued one by one are.
struct CounterWrite {
  uint64_t* counter;
  uint64_t value;
};
void signal_all(cudaStream_t stream, const CounterWrite* writes, size_t n);
// One cuStreamBatchMemOp of WAIT_VALUE_64 GEQ over every spec (split in batches of 255).
void wait_geq(cudaStream_t stream, const WaitSpec* specs, size_t n);

// ---- copies ----------------------------------------------------------------------------------
// One copy between device addresses (a program's CopyDesc once its BufRefs are resolved):
// `height` rows of `width` bytes; 1-D when height == 1.
struct ResolvedCopy {
  void* dst;
  const void* src;
  size_t width;
  size_t height;
  size_t dpitch;
  size_t spitch;
};
// Eager: the 1-D copies go in one cudaMemcpyBatchAsync (CUDA 13 signature) with attributes
// {srcAccessOrder = Stream, PreferOverlapWithCompute}; the 2-D copies in one cudaMemcpy3DBatchAsync
// (depth 1, same attributes), or per copy through cudaMemcpy2DAsync with Copy2D::kPerCopy.
// (A strided copy stays one descriptor: its rows as batched 1-D copies ran 2x slower on one H200,
// the batch paying a fixed cost per descriptor; BENCHMARKS.md.) Under graph capture and on the
// default streams every copy is its own call (batches cannot be captured). Copies inside one call
// are unordered with each other (callers never put dependent copies in one call).
void submit_copies(cudaStream_t stream, const ResolvedCopy* d, size_t n, Copy2D mode = Copy2D::kBatch);
bool stream_is_capturing(cudaStream_t stream);

// [Note: copies on SMs]
// The batch APIs above ask the driver for the copy engines (PreferOverlapWithCompute): between
// GPUs they keep a copy off the SMs that the SUMs and the framework's compute use (paper §4.1).
// Between two ranks that share one device (an emulated node: a virtual cluster's ranks on one
// GPU) no link limits a copy, HBM does, and the copy engines reach only about half of it on an
// H200 (BENCHMARKS.md, the one-node RS: rank 0's Level-1 pushes at 1.2-1.8x their byte floor,
// a copy kernel at 64 CTAs 0.99x). submit_copies_on_sms runs such copies as TIDE's copy kernel
// (kernels.h, SmCopy): kMaxSmCopies copies per launch, `ctas` CTAs each (ExecutorOptions
// copy_ctas), all on `stream`, graph-capturable. ExecutorOptions copies_on picks: auto (SMs for
// an op that copies between ranks sharing a device, copy engines otherwise), copy_engines, sms.
void submit_copies_on_sms(cudaStream_t stream, const ResolvedCopy* d, size_t n, int ctas);

// ---- copy lanes --------------------------------------------------------------------------------
// [Note: copy lanes] A COPY/PUT op's descriptors are unordered with each other, so a large op is
// spread over a few lanes: non-blocking streams forked from the issuing stream by an event and
// joined back before anything after the op (a PUT's bump included) is issued. Several lanes let
// several copy engines work (paper §6) and, on one GPU, let one driver copy kernel's tail overlap
// the next one's start. Lanes belong to ONE issuing (rank, program stream): lanes shared across
// streams would queue one stream's copies behind another's and could deadlock on cross waits.
// Copies go to the least-loaded lane, largest first; ops under the spread threshold stay on the
// issuing stream (each lane costs two event calls on the host).
// Lanes, the spread threshold and the 2-D copy mode are executor options (tide/exec_options.h).
class CopyLanes {
 public:
  CopyLanes(int device, int n, size_t spread_bytes, Copy2D mode = Copy2D::kBatch);
  ~CopyLanes();
  CopyLanes(const CopyLanes&) = delete;
  CopyLanes& operator=(const CopyLanes&) = delete;
  int size() const { return static_cast<int>(lanes_.size()); }
  size_t spread_bytes() const { return spread_bytes_; }
  // Issues d[0..n) ordered after `origin`'s prior work; `origin` waits for all of them.
  void submit(cudaStream_t origin, const ResolvedCopy* d, size_t n);

 private:
  void release() noexcept;
  int device_;
  size_t spread_bytes_;
  Copy2D mode_;
  std::vector<cudaStream_t> lanes_;
  cudaEvent_t fork_ = nullptr;
  std::vector<cudaEvent_t> join_;
};
// submit_copies through `lanes` when there are any and the op moves >= lanes->spread_bytes().
void submit_copies(cudaStream_t stream, const ResolvedCopy* d, size_t n, CopyLanes* lanes, Copy2D mode);

// Lanes per (rank, program stream), created by the first op that spreads (n >= 2 copies moving
// >= the spread threshold), so an executor whose ops are all small creates no extra stream;
// lanes <= 1 gives none.
class CopyLaneTable {
 public:
  CopyLaneTable(int lanes, size_t spread_bytes, Copy2D mode) : lanes_(lanes), spread_bytes_(spread_bytes), mode_(mode) {}
  explicit CopyLaneTable(const ExecutorOptions& o)
      : CopyLaneTable(o.copy_lanes, static_cast<size_t>(o.copy_spread_bytes), o.copy_2d) {}
  // The lanes for an op of `n` copies moving `bytes` from (rank, stream), or null: keep it on
  // its stream.
  CopyLanes* for_op(int rank, int stream, int device, size_t n, size_t bytes);
  int lanes() const { return lanes_; }
  Copy2D mode() const { return mode_; }

 private:
  int lanes_;
  size_t spread_bytes_;
  Copy2D mode_;
  std::map<std::pair<int, int>, std::unique_ptr<CopyLanes>> table_;
};

// DeviceGuard (the current device for a scope): tide/cuda.h.

// The executors' internal streams: fail_stop.h ([Note: internal streams]).

// ---- hang reports (stackdump.cc) -------------------------------------------------------------
// install_stack_dump(sig): on `sig`, the receiving thread and every registered thread (each
// watchdog) write their native backtraces to stderr. For machines without gdb.
void install_stack_dump(int sig);
void register_dump_thread(bool on);  // the calling thread joins (true) or leaves the dump

// ---- watchdog --------------------------------------------------------------------------------
// [Note: watchdog and fail-stop]
// Each batch of WAITs the executor enqueues (one wait, or the consecutive waits of one stream:
// issue.h [Note: enqueue order]) is followed by one event record on the same stream and
// registered here with its deadline and description (rank, op, sequence). A host thread polls
// the events; when one is overdue it (1) records a TimeoutError message naming the waits, and
// (2) releases the stuck stream by writing each wait's value into its awaited counter from a
// dedicated non-blocking rescue stream, so the GPU never stays hung. Any later check() throws
// tide::TimeoutError; the data produced after a release is garbage by design (fail-stop).
// Descriptions are built only when reported: the issue path registers a batch with WaitLabels
// (shared with the entry, so it outlives the program set) and the call's seq, and the watchdog
// asks the labels for the text when the batch is overdue. A batch of several waits names every
// wait in it (the stream stops at the first unsatisfied one; the watchdog does not read the
// counters to tell which). Registering takes the lock for a push and wakes the thread only when it
// sleeps idle; the thread polls its entries without the lock (an entry behind an unfinished one
// on its stream is not queried: events on one stream complete in order), so the issuing thread
// never waits behind a pass over hundreds of events.
// What a batch of watched waits reports when overdue, built only then.
class WaitLabels {
 public:
  virtual ~WaitLabels() = default;
  // The description of waits specs[0..n) (by their labels) of call `seq`.
  virtual std::string describe(const WaitSpec* specs, size_t n, int64_t seq) const = 0;
};

class Watchdog {
 public:
  explicit Watchdog(int device, double timeout_s);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Enqueue a wait on `stream` and watch it (deadline `timeout_s`, <= 0: the watchdog's).
  // Returns immediately.
  void watched_wait(cudaStream_t stream, const WaitSpec* specs, size_t n, const std::string& what,
                    double timeout_s = 0);
  // The same for a batch described lazily (labels->describe(specs, n, seq) when overdue) on a
  // stream of `device`.
  void watched_waits(cudaStream_t stream, int device, const WaitSpec* specs, size_t n,
                     std::shared_ptr<const WaitLabels> labels, int64_t seq, double timeout_s = 0);
  // Watch the work enqueued on `stream` so far (an event after it): past the deadline it is
  // reported like a stuck wait and `on_timeout` runs once on a thread of the watchdog's (a rail
  // group: abort the rail communicator so its kernel exits), which the destructor joins: what
  // on_timeout reaches must outlive the watchdog, and it should own nothing a face owns (a rail
  // is captured weakly).
  void watched_work(cudaStream_t stream, const std::string& what, std::function<void()> on_timeout,
                    double timeout_s = 0);
  // Block until every watched wait has completed or been released; throws TimeoutError then.
  void drain();
  // Throws TimeoutError if a wait was overdue.
  void check();
  double timeout_s() const { return timeout_s_; }
  void set_timeout(double s) { timeout_s_ = s; }

 private:
  struct Entry {
    cudaEvent_t done;
    cudaStream_t stream;
    int device;  // the watched stream's: an event records only on its own device's streams
    std::chrono::steady_clock::time_point deadline;
    std::vector<WaitSpec> specs;
    std::string what;                         // when labels is null
    std::shared_ptr<const WaitLabels> labels;  // else the description, built when reported
    int64_t seq = 0;
    std::function<void()> on_timeout;  // watched_work
    std::string describe() const { return labels ? labels->describe(specs.data(), specs.size(), seq) : what; }
  };
  void watch(cudaStream_t stream, int device, Entry e, double limit);
  void loop();
  void release(const Entry& e);

  int device_;
  double timeout_s_;
  cudaStream_t rescue_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> entries_;  // registered, not yet taken by the thread (mu_)
  std::vector<Entry> active_;   // the thread's (polled without mu_)
  size_t pending_ = 0;          // entries_ + active_ (mu_)
  bool idle_ = false;           // the thread sleeps until notified (mu_)
  std::map<int, std::vector<cudaEvent_t>> free_events_;  // per device (mu_)
  std::string error_;
  bool stop_ = false;
  std::thread thread_;
  std::vector<std::thread> late_;  // [Note: late work]: started by thread_, joined by ~Watchdog
};

}  // namespace tide::cuda
