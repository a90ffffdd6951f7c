// TIDE CUDA in-process executor: every rank of a fabric whose ranks all live in this process runs
// the same Programs as the CPU executor (program.h) on CUDA streams, through the shared issue
// path (issue.h: op mapping, [Note: enqueue order], fail-stop at enqueue time) over the shared
// streams, watchdog and fail-stop (fail_stop.h).
//
// Contract
//   - Registration: a program set's first run checks that every rank runs the same plan and
//     group (FaultKind::kOtherPlan is refused here), admits every rank's program onto the layout
//     (program_index.h admit()), cuts every SUM/LAND into a run table and uploads all tables once
//     (cached per set). Nothing is allocated or uploaded per call after.
//   - run(set, seq, buffers): enqueues call `seq` and returns; user buffers are plain device
//     pointers bound per call (RankBindings). synchronize() waits for what was enqueued (or throws).
//   - Fail-stop: after an error the executor refuses further calls (fail_stop.h).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "exec/cuda/fail_stop.h"
#include "exec/cuda/issue.h"
#include "exec/cuda/runtime.h"
#include "exec/cuda/staging_canary.h"
#include "fabric/fabric.h"
#include "tide/bindings.h"
#include "tide/program.h"
#include "tide/program_set.h"

namespace tide::cuda {

// The in-process executor: every rank of a fabric whose ranks all live in this process (an
// InProcessFabric: a virtual cluster on one GPU, or the XLA devices of one process).
//   - run(set, seq, buffers, caller_streams) enqueues call `seq` of any program set of the
//     fabric's ranks (sets of several groups and banks alternate over one executor). Each set
//     is registered once (checked: every rank runs the same plan and group, kOtherPlan is
//     refused; its layout fits the arena; run tables uploaded) and cached by identity and
//     version, as CudaRankExecutor caches its sets.
//   - Every rank's internal streams persist across calls and sets ([Note: internal streams]), so
//     stream s of call e+1 queues behind stream s of call e whatever sets they run.
//   - caller_streams[r] (empty: none) is rank r's caller stream: the call's streams wait for its
//     prior work, and it waits for the whole call (every internal stream joined) — no host sync.
//   - ExecutorOptions::graphs (one device, caller streams given, no canary): a call met again with
//     the same set and buffers is captured, then replayed as one graph launch on rank 0's stream
//     0, after every caller and every rank's previous call, and before the next call's streams
//     (the callers join it by events) ([Note: replayed calls], graph.h; [Note: replayed calls
//     serialise], executor.cc). Otherwise eager.
//   - With ExecutorOptions::staging_canary, every staged push and SUM is bracketed by the staging
//     canary's check and mark (staging_canary.h); a race it records fails synchronize() (and a
//     sync_every_call run) with its message, and the executor refuses later calls.
class CudaExecutor {
 public:
  CudaExecutor(std::shared_ptr<fabric::Fabric> fabric, const ExecutorOptions& opt);
  ~CudaExecutor();
  CudaExecutor(const CudaExecutor&) = delete;
  CudaExecutor& operator=(const CudaExecutor&) = delete;

  void run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<RankBindings>& buffers,
           const std::vector<cudaStream_t>& caller_streams = {});
  void synchronize();
  int world() const { return fabric_->world(); }
  cudaStream_t stream(int rank, int s) const;
  // Rank `rank`'s counter `index` in `set`'s layout (tests).
  uint64_t* counter_ptr(const ProgramSet& set, int rank, int index) const;
  CudaRunOptions& options() { return opt_; }  // fault injection (tests)
  void set_timeout(double timeout_s);         // later waits' deadline
  size_t cached_program_sets() const { return cache_.size(); }
  int64_t graph_captures() const { return graphs_ ? graphs_->captures() : 0; }
  int64_t graph_replays() const { return graphs_ ? graphs_->replays() : 0; }

 private:
  struct Entry;
  Entry& prepare(const std::shared_ptr<const ProgramSet>& set);
  // [Note: replayed calls]: capture() enqueues call `seq` (through `c`) into `cap`, forked from
  // and joined back into the capture stream; launch() launches a graph on rank 0's stream 0.
  void capture(GraphCapture& cap, IssueContext& c, int64_t seq);
  void launch(CallGraph& g, int64_t seq, const std::vector<cudaStream_t>& caller, bool advance);
  void check_canary();  // after the streams synchronised: a recorded staging race fails the executor

  std::shared_ptr<fabric::Fabric> fabric_;
  CudaRunOptions opt_;
  std::unique_ptr<FailStopStreams> fs_;  // [rank] streams, the watchdog, fail-stop
  std::vector<cudaEvent_t> ready_;       // [rank]: caller -> call
  CopyLaneTable lanes_;
  SetCache<Entry> cache_;
  std::unique_ptr<StagingCanary> canary_;  // ExecutorOptions::staging_canary
  std::unique_ptr<CallGraphs> graphs_;     // ExecutorOptions::graphs on one device
  cudaEvent_t fork_ = nullptr, done_ = nullptr;  // done_: the last replay's end
  bool after_replay_ = false;  // the next eager call's streams wait for done_ first
  std::mutex mu_;
};

}  // namespace tide::cuda
