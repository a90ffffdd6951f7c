// CudaRankExecutor: ONE rank's TIDE programs on CUDA streams, peers in other processes over a
// CUDA-IPC fabric (fabric/ipc.h) — the GPU twin of the CPU RankExecutor (tide/exec_cpu.h,
// docs/rank_executor.md). tide_torch runs one per torchrun process. It issues through the shared
// issue path (issue.h) over the shared streams, watchdog and fail-stop (fail_stop.h).
//
// Contract
//   - run(progs, seq, buffers, caller_stream, ranks) enqueues only this rank's ops of call `seq`
//     of a program set and returns without host-synchronising. Ops go in the global enqueue order
//     (issue.h, [Note: enqueue order]); a wait whose producer is local and never issued fails
//     at enqueue time (TimeoutError); waits on remote producers are left to the watchdog, whose
//     TimeoutError (from synchronize() or the next run) names rank, op, seq and the counter.
//   - Caller stream interop: program stream 0 (the caller's stream in the IR) is an internal
//     stream that first waits for the caller's prior work (an event recorded on `caller_stream`),
//     and the caller stream then waits for the whole call (an event after every internal stream
//     has joined stream 0). 0 is the legacy default stream; torch's current stream may be passed.
//   - Program sets may differ per call (AG/RS of several groups, RS banks): each set is prepared
//     once (producer map, run tables uploaded) and cached by its identity and version (the
//     caller bumps the version when it mutates a set in place, e.g. fault injection); a set that
//     dies, or whose version changed, is dropped from the cache at the next run.
//   - Arena layout: `regions` (name -> (offset, bytes), as RankExecutor) for sets not built with
//     arena=; sets built with arena= use their own layout, whose "counters" must be the
//     executor's. Without regions, every set uses its own layout.
//   - Entry fence (default on), as RankExecutor's [Note: entry fence]: the last counter of region
//     "counters" is the executor's; every run k writes fence_started(k) there (cuStreamWriteValue64
//     on stream 0, after the caller's prior work) and waits (WAIT_VALUE_64 GEQ, watched) until
//     every peer it writes into has started run k (where it lands in their ring slots) or
//     finished run k - 1 (else); fence_finished(k) follows the run's join. Every rank must issue
//     the same run sequence.
//   - One CudaRankExecutor per fabric: the entry fence counts this executor's runs. The caller's
//     current device is left as it was.
//   - Two-sided rails (ExecutorOptions::rails = two_sided, set_rail): only the arenas of this
//     rank's topology node need be open in the fabric; SEND/RECV groups run on the rail's NCCL
//     communicator from the rail_p2p stream, watched (a late group aborts the rail and raises).
//   - ExecutorOptions::graphs: a call met again with the same set and buffers is captured and
//     then replayed as one CUDA graph launch on stream 0, after the caller's prior work and the
//     previous call, as an eager call runs ([Note: replayed calls], graph.h; [Note: replayed calls
//     serialise]); the entry fence runs inside the graph with the run number as a call parameter.
//   - Several ranks of one process (fabric peers given as same_process, fabric/ipc.h, before the
//     executors are made), each with its own executor and thread: eager calls take turns on the
//     fabric's IssueBoard, so the
//     process enqueues in one global order ([Note: same-process issue gate], fabric/fabric.h;
//     ExecutorOptions::issue_gate); run() then returns once this rank's steps are enqueued, which
//     may wait for the other ranks' threads to reach the call (TimeoutError past timeout_s).
//   - Fail-stop: after any error the executor refuses further calls. Bad input (buffers too small
//     or missing, regions absent, programs for another topology) is a PlanError/Error before
//     anything is enqueued.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "exec/cuda/fail_stop.h"
#include "exec/cuda/issue.h"
#include "fabric/fabric.h"
#include "fabric/nccl.h"
#include "tide/bindings.h"
#include "tide/exec_cpu.h"
#include "tide/program.h"
#include "tide/program_set.h"

namespace tide::cuda {

class CudaRankExecutor {
 public:
  // regions empty: every program set uses its own arena layout.
  CudaRankExecutor(std::shared_ptr<fabric::Fabric> fabric, int rank, const Topology& topo, const RegionTable& regions,
                   const ExecutorOptions& opt, bool fence = true);
  ~CudaRankExecutor();
  CudaRankExecutor(const CudaRankExecutor&) = delete;
  CudaRankExecutor& operator=(const CudaRankExecutor&) = delete;

  // set: one Program per group rank; its identity and version key the cache; a set built with
  // arena= (arena_bound) uses its own layout. buffers: this rank's user buffers. ranks: a
  // sub-group's fabric ranks (nullptr: every rank).
  void run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const RankBindings& buffers,
           cudaStream_t caller_stream, const std::vector<int>* ranks = nullptr);
  void synchronize();
  void set_timeout(double timeout_s);  // later waits' deadline
  Rails rails() const { return opt_.rails; }
  // The rail of two-sided programs ([Note: NCCL rail], fabric/nccl.h): this rank's local index,
  // rail rank = rank / gpus_per_node.
  void set_rail(std::shared_ptr<fabric::NcclRail> rail);
  int rank() const { return rank_; }
  int world() const { return fabric_->world(); }
  size_t cached_program_sets() const { return cache_.size(); }
  uint64_t runs_started() const { return runs_; }
  // Calls captured and replayed ([Note: replayed calls], graph.h; ExecutorOptions::graphs).
  int64_t graph_captures() const { return graphs_ ? graphs_->captures() : 0; }
  int64_t graph_replays() const { return graphs_ ? graphs_->replays() : 0; }
  // Runs whose entry fence waited for the peers' arrival (a TIDE-AG landing in their ring slots:
  // one cross-rank round more than the data, [Note: entry fence]).
  uint64_t arrival_fences() const { return arrival_fences_; }

 private:
  struct Entry;
  Entry& prepare(const std::shared_ptr<const ProgramSet>& set, const std::vector<int>& members);
  void check_buffers(const Entry& e, const RankBindings& b) const;
  // The entry fence in its two halves ([Note: entry fence]): fence_started(k) written, then the
  // waits for the peers' fence_target; finish_run writes fence_finished(k) after the call joined.
  void fence_start(const Entry& e, GraphCapture* graph = nullptr);
  void fence_wait(const Entry& e, int64_t seq, const std::vector<Program>& progs, GraphCapture* graph = nullptr);
  void finish_run(const Entry& e, cudaStream_t joined, GraphCapture* graph);
  uint64_t* fence_ptr(const Entry& e, int g) const;
  // The call's turns on the fabric's IssueBoard, or none ([Note: same-process issue gate]).
  std::unique_ptr<fabric::IssueTurns> turns(const Entry& e, int64_t seq);
  // [Note: replayed calls]: capture() enqueues the call (through `c`) into `cap`, forked from and
  // joined back into the capture stream; replay() launches a graph on stream 0, ordered after
  // `caller` and the previous call, watched ([Note: replayed calls serialise]).
  void capture(const Entry& e, GraphCapture& cap, IssueContext& c, int64_t seq, const std::vector<Program>& progs);
  void replay(CallGraph& g, int64_t seq, cudaStream_t caller, bool advance);

  std::shared_ptr<fabric::Fabric> fabric_;
  std::shared_ptr<fabric::NcclRail> rail_;
  std::shared_ptr<fabric::IssueBoard> board_;  // joined: this rank takes turns there
  int rank_;
  Topology topo_;
  ArenaSpec layout_;
  bool have_layout_;
  CudaRunOptions opt_;
  bool fence_;
  int device_;
  uint64_t runs_ = 0;
  uint64_t arrival_fences_ = 0;  // runs enqueued (the entry fence's "started run #k")
  CopyLaneTable lanes_;
  std::unique_ptr<FailStopStreams> fs_;  // slot 0: this rank's streams; the watchdog, fail-stop
  cudaEvent_t ev_caller_ = nullptr, ev_entry_ = nullptr;
  std::unique_ptr<CallGraphs> graphs_;  // ExecutorOptions::graphs
  SetCache<Entry> cache_;
  std::mutex mu_;
};

}  // namespace tide::cuda
