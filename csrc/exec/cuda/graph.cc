// Captured calls ([Note: replayed calls], graph.h): the mirror record, the per-set cache and the
// executor's capture / launch / fault pieces. Every CUDA return code is checked.
#include "exec/cuda/graph.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "tide/cuda.h"
#include "tide/errors.h"

namespace tide::cuda {

// ---- the host mirror ------------------------------------------------------------------------------
bool MirrorAdvance::Key::operator<(const Key& o) const {
  return std::tie(rank, n, index) < std::tie(o.rank, o.n, o.index);
}

void MirrorAdvance::add(int fabric_rank, int num_counters, int index, uint64_t v) {
  adds_[Key{fabric_rank, num_counters, index}] += v;
}

void MirrorAdvance::raise(int fabric_rank, int num_counters, int index, GraphValue v) {
  raises_.push_back({Key{fabric_rank, num_counters, index}, v});
}

void MirrorAdvance::apply(fabric::Fabric& f, int64_t seq, uint64_t run) const {
  for (const auto& [k, v] : adds_) f.issued(k.rank, static_cast<size_t>(k.n))[static_cast<size_t>(k.index)] += v;
  for (const auto& [k, v] : raises_) {
    const int64_t t = v.value + v.per_call * (v.by_run ? static_cast<int64_t>(run) : seq);
    uint64_t& sh = f.issued(k.rank, static_cast<size_t>(k.n))[static_cast<size_t>(k.index)];
    sh = std::max(sh, static_cast<uint64_t>(std::max<int64_t>(0, t)));
  }
}

namespace {
// FNV-1a over every pointer and size of `r`, continuing from `h`.
uint64_t mix_bindings(uint64_t h, const RankBindings& r) {
  auto mix = [&](uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h ^= (x >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const auto& kind : r.by_kind) {
    mix(kind.size());
    for (const UserBuffer& u : kind) {
      mix(reinterpret_cast<uintptr_t>(u.data));
      mix(static_cast<uint64_t>(u.bytes));
    }
  }
  return h;
}
constexpr uint64_t kFnvBasis = 1469598103934665603ull;
}  // namespace

uint64_t bindings_key(const RankBindings& b) { return mix_bindings(kFnvBasis, b); }

uint64_t bindings_key(const std::vector<RankBindings>& b) {
  uint64_t h = kFnvBasis;
  for (const RankBindings& r : b) h = mix_bindings(h, r);
  return h;
}

// ---- per set ------------------------------------------------------------------------------------
CallGraph::~CallGraph() {  // teardown: unchecked
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  if (params) cudaFree(params);
}

GraphCapture::~GraphCapture() {
  if (params) cudaFree(params);  // an abandoned capture's slot; unchecked
}

SetGraphs::Decision SetGraphs::decide(uint64_t key) {
  Decision d;
  auto g = graphs_.find(key);
  if (g != graphs_.end()) {
    d.graph = g->second.get();
    return d;
  }
  if (graphs_.size() >= kMaxGraphs) return d;
  if (seen_.size() > 64) seen_.clear();
  d.capture = ++seen_[key] >= 2;
  return d;
}

CallGraph& SetGraphs::add(uint64_t key, std::unique_ptr<CallGraph> g) {
  seen_.erase(key);
  auto& slot = graphs_[key];
  slot = std::move(g);
  return *slot;
}

// ---- per executor -------------------------------------------------------------------------------
CallGraphs::CallGraphs(int device, double timeout_s) : device_(device), timeout_s_(timeout_s) {
  DeviceGuard guard(device, "CallGraphs: ");
  TIDE_CHECK_CUDA(cudaStreamCreateWithFlags(&origin_, cudaStreamNonBlocking), "the capture stream");
  TIDE_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host_flags_), sizeof(GraphFlags), cudaHostAllocMapped),
                  "graph flags");
  std::memset(host_flags_, 0, sizeof(GraphFlags));
  TIDE_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_flags_), host_flags_, 0),
                  "graph flags (device view)");
  TIDE_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&fault_), sizeof(GraphFault)), "graph fault record");
  GraphFault none{};
  none.wait = -1;
  TIDE_CHECK_CUDA(cudaMemcpy(fault_, &none, sizeof(none), cudaMemcpyHostToDevice), "graph fault record");
}

CallGraphs::~CallGraphs() {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) return;
  if (cudaSetDevice(device_) == cudaSuccess) {  // teardown: unchecked
    if (fault_) cudaFree(fault_);
    if (host_flags_) cudaFreeHost(host_flags_);
    if (origin_) cudaStreamDestroy(origin_);
  }
  cudaSetDevice(prev);
}

std::unique_ptr<GraphCapture> CallGraphs::begin() {
  auto cap = std::make_unique<GraphCapture>();
  TIDE_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&cap->params), sizeof(CallParams)), "graph call parameters");
  cap->fault = fault_;
  cap->flags = dev_flags_;
  cap->timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
  cap->graph_id = static_cast<int32_t>(waits_.size());
  waits_.emplace_back();
  return cap;
}

void launch_head(GraphCapture& cap, cudaStream_t origin) {
  launch_graph_head(cap.params, 0, 0, origin);  // the arguments are set per launch
  cudaStreamCaptureStatus st{};
  const cudaGraphNode_t* deps = nullptr;
  size_t n = 0;
  TIDE_CHECK_CUDA(cudaStreamGetCaptureInfo(origin, &st, nullptr, nullptr, &deps, nullptr, &n), "the capture's head");
  TIDE_CHECK(st == cudaStreamCaptureStatusActive && n == 1, "capturing a call: the head is not the capture's tail");
  cap.head = deps[0];
}

std::unique_ptr<CallGraph> CallGraphs::finish(cudaGraph_t g, GraphCapture& cap) {
  auto out = std::make_unique<CallGraph>();
  out->id = cap.graph_id;
  out->params = cap.params;
  cap.params = nullptr;  // owned by the graph now
  out->advance = std::move(cap.advance);
  waits_[static_cast<size_t>(cap.graph_id)] = std::move(cap.waits);
  // The head: the capture's first node (a root); every other root (work of a stream that joined
  // the capture without an edge from it) is made to follow it, so that no graph op reads the call
  // parameters before the head wrote them.
  out->graph = g;  // kept: its head node names the exec's node in per-launch updates
  size_t n = 0;
  cudaError_t rc = cudaGraphGetRootNodes(g, nullptr, &n);
  std::vector<cudaGraphNode_t> roots(n);
  if (rc == cudaSuccess) rc = cudaGraphGetRootNodes(g, roots.data(), &n);
  TIDE_CHECK_CUDA(rc, "reading a captured call's root nodes");
  const cudaGraphNode_t head = cap.head;
  TIDE_CHECK(head != nullptr && std::find(roots.begin(), roots.end(), head) != roots.end(),
             "capturing a call: the head kernel is not a root of its graph");
  for (size_t i = 0; i < n; ++i)
    if (roots[i] != head)
      TIDE_CHECK_CUDA(cudaGraphAddDependencies(g, &head, &roots[i], nullptr, 1), "ordering a root after the head");
  out->head = head;
  if (rc == cudaSuccess) rc = cudaGraphInstantiate(&out->exec, g, 0);
  TIDE_CHECK_CUDA(rc, "instantiating a captured call");
  return out;
}

void CallGraphs::launch(CallGraph& g, fabric::Fabric& f, int64_t seq, uint64_t run, cudaStream_t stream,
                        bool advance) {
  cudaKernelNodeParams kp{};
  void* args[] = {&g.params, &seq, &run};
  static const void* const head_kernel = graph_kernels()[0];
  kp.func = const_cast<void*>(head_kernel);
  kp.gridDim = dim3(1);
  kp.blockDim = dim3(1);
  kp.kernelParams = args;
  TIDE_CHECK_CUDA(cudaGraphExecKernelNodeSetParams(g.exec, g.head, &kp), "setting a replay's call parameters");
  TIDE_CHECK_CUDA(cudaGraphLaunch(g.exec, stream), "launching a captured call");
  if (advance) g.advance.apply(f, seq, run);
  ++replays_;
}

void CallGraphs::check(FailStopStreams& fs) const {
  const std::string f = fault();
  if (f.empty()) return;
  fs.fail(f);
  throw TimeoutError(f);
}

std::string CallGraphs::fault() const {
  if (!reinterpret_cast<volatile GraphFlags*>(host_flags_)->faulted) return {};
  GraphFault r{};
  {
    DeviceGuard guard(device_, "CallGraphs: ");
    if (cudaMemcpy(&r, fault_, sizeof(r), cudaMemcpyDeviceToHost) != cudaSuccess)
      return "a replayed wait passed its deadline (its record could not be read)";
  }
  std::string what = "a replayed wait";
  if (r.graph >= 0 && static_cast<size_t>(r.graph) < waits_.size() && r.wait >= 0 &&
      static_cast<size_t>(r.wait) < waits_[static_cast<size_t>(r.graph)].size())
    what = waits_[static_cast<size_t>(r.graph)][static_cast<size_t>(r.wait)];
  return TIDE_STR_CAT(what, " seq ", r.seq, ": not satisfied within ", timeout_s_, " s in a replayed call (saw ",
                      r.seen, ", needs >= ", r.target, "): its producer is behind, stalled or dead");
}

}  // namespace tide::cuda
