// Calls replayed as CUDA graphs: the pieces both CUDA executors share (the device-side call
// parameters, the graph ops, the host's record of what one call does to the counter mirror, and
// the per-executor cache of captured calls). The executors decide when to capture and replay
// (executor.cc, rank_executor.cc); the issue path (issue.cc) emits graph ops instead of stream
// memory operations while capturing.
//
// [Note: replayed calls]
// Eager issue bakes call `seq` into its operations: a SIGNAL writes the host mirror's value
// (shadow + v), a WAIT waits for value + per_call * seq, the entry fence writes run #k. A graph
// replays the same operations with new values, so under capture those three become graph ops
// that compute their value on the device from the call's parameters (CallParams: seq, run),
// which the graph's first node (the head; every other root of the captured graph is ordered after
// it before instantiation) writes from its kernel arguments; the executor sets
// those arguments per launch (cudaGraphExecKernelNodeSetParams), a single host call:
//   - WAIT / EVENT_WAIT / fence wait -> graph_wait: one thread spins until
//     *counter >= value + per_call * seq (or >= run), exactly the eager GEQ;
//   - PUT / SIGNAL / CREDIT / RECV bump -> graph_add: atomicAdd(counter, v) after a system fence.
//     A counter has one producer, so on the device the eager write of shadow + v and the add
//     leave the same value;
//   - EVENT_RECORD / fence signal -> graph_raise: atomicMax(counter, target(seq) or run).
// A replay of call `seq` therefore performs exactly the operations eager issue performs for
// `seq`, in the same stream order, and the counter protocol the checker proves for consecutive
// calls (I1-I4, App. E) holds unchanged: a replay is an eager call whose values are computed on
// the device. Eager calls and replays can follow each other in any order because the host's
// counter mirror (Fabric::issued) is advanced at each replay by what the capture recorded
// (MirrorAdvance: the sum of adds per counter, and the raises).
// Fail-stop in a replay: a graph_wait that passes its deadline records itself in the executor's
// GraphFault (wait id, graph, seq, target, seen) and raises the host-mapped abort flag; every
// other graph_wait of the executor then returns at once (the data is garbage by design, as after
// the watchdog's release of an eager wait). The watchdog watches each launch as one piece of work;
// past the deadline it raises the abort flag too and aborts the rail (a rail group's NCCL kernel
// is released only by ncclCommAbort). The executor reports the fault, naming rank, op and seq from
// the capture's wait descriptions, at its next run() or synchronize().
// Teardown: NCCL's communicator teardown waits for every graph that captured its work, so an
// executor (its graphs) is destroyed before the rail it replays is closed.
// Capture: the executor captures a call (cudaStreamCaptureModeThreadLocal, so the watchdog's
// thread keeps polling) on its own origin stream, which forks every internal stream with events
// and joins them back; the host-side enqueue-order simulation ([Note: enqueue order]) runs at
// capture as at eager issue. Copies become per-copy nodes (runtime.h: batches cannot be captured).
// A replay is launched where its eager call would run: on the executor's stream 0, after the
// caller's prior work and the executor's previous call, with the caller waiting for it (the entry
// fence and the scratch that groups share rely on one rank's runs following each other; [Note:
// replayed calls serialise], rank_executor.cc).
// A call is captured on its second appearance with the same program set and the same buffer
// pointers (keyed by every bound pointer and size), and replayed on every later one; a call whose
// pointers change every time stays eager. The first call of a set is always eager.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "exec/cuda/fail_stop.h"
#include "fabric/fabric.h"
#include "tide/bindings.h"
#include "tide/errors.h"

namespace tide::cuda {

// The device-side parameters of one replay (one per captured graph, device memory).
struct CallParams {
  int64_t seq;
  uint64_t run;  // the rank executor's entry fence run number
};

// The executor's fault record (device memory: the first graph_wait past its deadline claims it).
struct GraphFault {
  int32_t wait;    // -1: none; else the wait id within its graph
  int32_t graph;   // the graph's id (CallGraph::id)
  int64_t seq;
  uint64_t target;
  uint64_t seen;
};
// The executor's flags (host-mapped; plain stores from either side).
struct GraphFlags {
  int32_t abort;    // set: every graph_wait returns at once
  int32_t faulted;  // set: GraphFault holds a record
};

// What a replay's value computation reads: value + per_call * seq, or value + per_call * run
// (by_run: the entry fence's values, [Note: entry fence]).
struct GraphValue {
  int64_t value = 0;
  int64_t per_call = 0;
  bool by_run = false;
};

void launch_graph_head(CallParams* p, int64_t seq, uint64_t run, cudaStream_t stream);
void launch_graph_wait(const uint64_t* counter, GraphValue v, const CallParams* p, uint64_t timeout_ns,
                       GraphFault* fault, GraphFlags* flags, int32_t wait_id, int32_t graph_id,
                       cudaStream_t stream);
void launch_graph_add(uint64_t* counter, uint64_t v, cudaStream_t stream);
void launch_graph_raise(uint64_t* counter, GraphValue v, const CallParams* p, cudaStream_t stream);
// The graph ops' kernels, which preload_kernels() loads with the others ([Note: eager kernel
// loading], kernels.h); [0] is the head's (per-launch node updates).
std::vector<const void*> graph_kernels();

// What one call does to the host's counter mirror (Fabric::issued), recorded at capture.
class MirrorAdvance {
 public:
  void add(int fabric_rank, int num_counters, int index, uint64_t v);
  void raise(int fabric_rank, int num_counters, int index, GraphValue v);
  void apply(fabric::Fabric& f, int64_t seq, uint64_t run) const;

 private:
  struct Key {
    int rank, n, index;
    bool operator<(const Key& o) const;
  };
  std::map<Key, uint64_t> adds_;
  std::vector<std::pair<Key, GraphValue>> raises_;
};

// The graph ops' context while a call is being captured (IssueContext::graph).
struct GraphCapture {
  CallParams* params = nullptr;  // device
  GraphFault* fault = nullptr;   // device
  GraphFlags* flags = nullptr;   // device view of the host-mapped flags
  cudaGraphNode_t head = nullptr;  // launch_head()'s node
  uint64_t timeout_ns = 0;
  int32_t graph_id = 0;
  MirrorAdvance advance;
  std::vector<std::string> waits;  // description of wait id i (rank, op, counter; no seq)
  // A wait of the call: its id, after appending its description.
  int32_t add_wait(std::string what) {
    waits.push_back(std::move(what));
    return static_cast<int32_t>(waits.size() - 1);
  }
  GraphCapture() = default;
  ~GraphCapture();
  GraphCapture(const GraphCapture&) = delete;
  GraphCapture& operator=(const GraphCapture&) = delete;
};

// Enqueues the head on `origin`, the capture's first stream, and notes its node in `cap`.
void launch_head(GraphCapture& cap, cudaStream_t origin);

// The key of a call's buffers: every bound pointer and size of the local ranks (one rank's).
uint64_t bindings_key(const std::vector<RankBindings>& b);
uint64_t bindings_key(const RankBindings& b);

// One captured call: its executable graph, head node and parameter slot (freed with it).
struct CallGraph {
  int32_t id = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t head = nullptr;
  CallParams* params = nullptr;
  MirrorAdvance advance;
  ~CallGraph();
};

// The captured calls of one prepared program set (an executor's set entry holds one, so the
// graphs die with the entry, after the set cache's quiesce). At most kMaxGraphs buffer keys are
// captured per set; later keys stay eager.
class SetGraphs {
 public:
  static constexpr size_t kMaxGraphs = 8;
  // Replay `graph`, capture now (`capture`: the key's second sighting), or issue eagerly.
  struct Decision {
    CallGraph* graph = nullptr;
    bool capture = false;
  };
  Decision decide(uint64_t buffers_key);
  CallGraph& add(uint64_t buffers_key, std::unique_ptr<CallGraph> g);

 private:
  std::map<uint64_t, std::unique_ptr<CallGraph>> graphs_;
  std::map<uint64_t, int> seen_;  // keys met once (bounded: cleared past 64)
};

// One executor's graph machinery: the fault record, the wait descriptions of every capture
// (by graph id, for the fault message), the capture stream, capture and launch. Not
// thread-safe (the executor's lock).
class CallGraphs {
 public:
  CallGraphs(int device, double timeout_s);
  ~CallGraphs();
  CallGraphs(const CallGraphs&) = delete;
  CallGraphs& operator=(const CallGraphs&) = delete;

  // The executors' one entry for a call that may replay: raises a recorded fault (failing `fs`),
  // then replays the call's graph of `sg` (launch(graph, true)), or captures it (capture(cap),
  // which enqueues the call into the capture that begins on origin() after the head and joins
  // it back there) and launches the new graph (launch(graph, false): the capture advanced the
  // mirror). Returns false when the call is to be issued eagerly (nothing done).
  template <class Capture, class Launch>
  bool run(SetGraphs& sg, uint64_t key, FailStopStreams& fs, Capture&& capture, Launch&& launch) {
    check(fs);
    const SetGraphs::Decision d = sg.decide(key);
    if (d.graph == nullptr && !d.capture) return false;
    fs.guarded([&] {
      if (d.graph != nullptr)
        launch(*d.graph, true);
      else
        launch(sg.add(key, record(capture)), false);
    });
    return true;
  }
  // Launches `g` for call `seq` (run: the entry fence's) on `stream`; advance: `f`'s mirror by
  // the graph's record.
  void launch(CallGraph& g, fabric::Fabric& f, int64_t seq, uint64_t run, cudaStream_t stream, bool advance);
  // Raises a recorded fault (TimeoutError naming the wait, rank, op and seq), failing `fs`.
  void check(FailStopStreams& fs) const;
  // Empty when no replayed wait passed its deadline; else "<wait description> seq S: ...".
  std::string fault() const;
  void abort() { reinterpret_cast<volatile GraphFlags*>(host_flags_)->abort = 1; }
  void set_timeout(double s) { timeout_s_ = s; }
  cudaStream_t origin() const { return origin_; }
  int64_t captures() const { return static_cast<int64_t>(waits_.size()); }
  int64_t replays() const { return replays_; }

 private:
  template <class Capture>
  std::unique_ptr<CallGraph> record(Capture& capture) {
    std::unique_ptr<GraphCapture> cap = begin();
    cudaGraph_t g = nullptr;
    TIDE_CHECK_CUDA(cudaStreamBeginCapture(origin_, cudaStreamCaptureModeThreadLocal), "capturing a call");
    try {
      launch_head(*cap, origin_);
      capture(*cap);
    } catch (...) {
      cudaStreamEndCapture(origin_, &g);  // abandon it
      if (g) cudaGraphDestroy(g);
      throw;
    }
    TIDE_CHECK_CUDA(cudaStreamEndCapture(origin_, &g), "ending the capture of a call");
    return finish(g, *cap);
  }
  std::unique_ptr<GraphCapture> begin();
  std::unique_ptr<CallGraph> finish(cudaGraph_t g, GraphCapture& cap);

  int device_;
  double timeout_s_;
  cudaStream_t origin_ = nullptr;  // captures begin and end here
  GraphFlags* host_flags_ = nullptr;
  GraphFlags* dev_flags_ = nullptr;
  GraphFault* fault_ = nullptr;  // device
  std::vector<std::vector<std::string>> waits_;  // [graph id][wait id]
  int64_t replays_ = 0;
};

}  // namespace tide::cuda
