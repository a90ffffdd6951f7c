// TIDE's CUDA executor behind the XLA FFI handlers ([Note: the executor boundary], executor.cc).
//
// One process: the ranks of a group are XLA devices of this process (rank r on its device
// ordinal; a virtual cluster puts every rank on one device), so the group runs on one
// tide::cuda::CudaExecutor over a fabric::InProcessFabric, exactly as tide/cluster_cuda.py runs
// it. Rank 0's handler thread enqueues the call for every rank after the rendezvous; nothing
// here waits on the host.
//
// [Note: stream handoff] Per call, rank r:
//   handler (rank r's thread)   ready[r] <- event recorded on XLA's stream (record_ready)
//   runner  (rank 0's thread)   every executor stream of rank r waits ready[r]; run(seq);
//                               every stream s >= 1 records joined[r][s], stream 0 waits them;
//                               AG: stream 0 copies rank r's landing into XLA's results;
//                               stream 0 records done[r]
//   CompleteRank (r's thread)   XLA's stream waits done[r]
// Stream 0 (the IR's caller stream) does not end after the other streams: TIDE-AG records its
// release event (SENDS) on stream 0 but done_event (DONE, after the node-wide completion fence)
// on the completion stream, so stream 0 explicitly joins every stream before done[r]. Every
// stream (not only stream 0) waits ready[r]: the readiness stream signals READY to the peers,
// which then push into rank r's landing; it must not run before XLA's stream has passed the
// previous call's landing copy. Peers never touch rank r's XLA buffers (push rule), and rank r's
// streams all finish before done[r], so XLA may reuse its buffers once its stream passed done[r].
//
// Events live in the group state and are re-recorded per call: the rendezvous' completion fence
// (every rank waits until every rank finished) orders the runner's cudaStreamWaitEvent on
// ready[r] before rank r's next record, and rank r's wait on done[r] before the next call's.
//
// Errors: construction and enqueue errors throw as on the CPU (PlanError -> INVALID_ARGUMENT, a
// wait whose producer is never issued -> TimeoutError -> DEADLINE_EXCEEDED). A wait that is late
// on the device is released by the executor's watchdog and reported at synchronize(); with
// TIDE_XLA_CUDA_SYNC=1 the runner synchronises after every call (debugging: that error then
// becomes DEADLINE_EXCEEDED of the call).
#ifdef TIDE_WITH_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "exec/cuda/executor.h"
#include "exec/cuda/runtime.h"
#include "fabric/inprocess.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

namespace {

// Restores the calling thread's CUDA device (XLA's threads keep their own).
class DeviceGuard {
 public:
  DeviceGuard() { TIDE_CHECK_CUDA(cudaGetDevice(&prev_)); }
  ~DeviceGuard() { cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

cudaEvent_t new_event(int device) {
  TIDE_CHECK_CUDA(cudaSetDevice(device), "device ", device);
  cudaEvent_t e = nullptr;
  TIDE_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

struct CudaGroupState {
  std::mutex mu;
  std::vector<int> devices;  // rank -> CUDA device
  std::shared_ptr<fabric::InProcessFabric> fabric;
  std::map<ProgramKey, std::unique_ptr<cuda::CudaExecutor>> executors;
  std::vector<std::vector<cudaEvent_t>> joined;  // [rank][s - 1]: stream s finished the call
  std::vector<cudaEvent_t> done;                 // [rank]: the call (and AG's copy) finished
  int64_t seq = 0;
};

// Per (plan, collective, mesh group, virtual device, rank devices). States live as long as the
// process and are never destroyed: their streams and arenas would otherwise be torn down in a
// static destructor, after the CUDA runtime may already have shut down.
CudaGroupState& state_for(const GroupCall& call, const std::vector<int>& devices) {
  std::ostringstream key;
  key << call.plan->hash << '|' << int(call.spec.op) << '|' << call.group << '|'
      << call.virtual_device << '|';
  for (int d : devices) key << d << ',';
  static std::mutex mu;
  static auto* states = new std::map<std::string, std::unique_ptr<CudaGroupState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& st = (*states)[key.str()];
  if (!st) {
    st = std::make_unique<CudaGroupState>();
    st->devices = devices;
  }
  return *st;
}

cuda::CudaExecutor& executor_for(CudaGroupState& st, const GroupCall& call, int64_t seq) {
  const ProgramKey key = program_key(call, seq);
  auto it = st.executors.find(key);
  if (it != st.executors.end()) return *it->second;
  std::vector<Program> progs = build_call_programs(call, std::get<0>(key));
  if (!st.fabric)  // zeroed arenas: every counter starts at epoch 0
    st.fabric = std::make_shared<fabric::InProcessFabric>(st.devices, progs[0].arena.total);
  TIDE_CHECK(progs[0].arena.total == st.fabric->arena_bytes(),
             "programs of one group disagree on the arena layout");
  cuda::ExecOptions opt;
  opt.timeout_s = static_cast<double>(call.timeout_ms) / 1000.0;
  // Executors of one group (TIDE-RS's two banks, other alphas) share the fabric and with it the
  // counters' issued values, so they continue each other's epochs.
  auto ex = std::make_unique<cuda::CudaExecutor>(st.fabric, std::move(progs), opt);
  const size_t n = st.devices.size();
  if (st.done.empty()) {
    st.joined.resize(n);
    for (size_t r = 0; r < n; ++r) st.done.push_back(new_event(st.devices[r]));
  }
  for (size_t r = 0; r < n; ++r) {
    const size_t ns = std::max<size_t>(1, ex->program(static_cast<int>(r)).streams.size());
    while (st.joined[r].size() + 1 < ns) st.joined[r].push_back(new_event(st.devices[r]));
  }
  return *st.executors.emplace(key, std::move(ex)).first->second;
}

std::vector<cuda::RankBuffers> buffers_for(const GroupCall& call) {
  const GroupLayout& lay = call.plan->layout;
  std::vector<cuda::RankBuffers> b(static_cast<size_t>(lay.N));
  for (int r = 0; r < lay.N; ++r) {
    const RankIo& io = *call.ranks[static_cast<size_t>(r)];
    auto& dst = call.spec.op == Collective::kAllGather ? b[r].shard : b[r].grad;
    for (int p = 0; p < lay.P; ++p) dst.push_back(const_cast<void*>(io.in[p]));
    if (call.spec.op == Collective::kReduceScatter) b[r].out = io.out[0];
  }
  return b;
}

bool sync_every_call() {
  static const bool on = [] {
    const char* v = std::getenv("TIDE_XLA_CUDA_SYNC");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

}  // namespace

void record_ready(RankIo& io) {
  TIDE_CHECK(io.stream != nullptr && io.device >= 0, "record_ready: no XLA stream");
  static std::mutex mu;
  static auto* events = new std::map<int, cudaEvent_t>();  // per device, never destroyed
  DeviceGuard guard;
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& slot = (*events)[io.device];
    if (slot == nullptr) slot = new_event(io.device);
    ev = slot;
  }
  TIDE_CHECK_CUDA(cudaSetDevice(io.device), "device ", io.device);
  TIDE_CHECK_CUDA(cudaEventRecord(ev, static_cast<cudaStream_t>(io.stream)), "XLA stream");
  io.ready = ev;
}

void copy_accumulator_async(const RankIo& io, int64_t bytes) {
  if (io.acc.empty() || io.acc[0] == io.out[0]) return;  // XLA aliased it: in place already
  DeviceGuard guard;
  TIDE_CHECK_CUDA(cudaSetDevice(io.device), "device ", io.device);
  TIDE_CHECK_CUDA(cudaMemcpyAsync(io.out[0], io.acc[0], static_cast<size_t>(bytes),
                                  cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(io.stream)),
                  "accumulator -> result");
}

void ExecuteGroupCuda(const GroupCall& call) {
  DeviceGuard guard;
  const GroupLayout& lay = call.plan->layout;
  const int N = lay.N;
  TIDE_CHECK(static_cast<int>(call.ranks.size()) == N, "ExecuteGroupCuda: ", call.ranks.size(),
             " ranks for a group of ", N);
  std::vector<int> devices(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    const RankIo& io = *call.ranks[static_cast<size_t>(r)];
    TIDE_CHECK(io.device >= 0 && io.stream != nullptr && io.ready != nullptr, "rank ", r,
               ": no device, XLA stream or ready event");
    devices[static_cast<size_t>(r)] = io.device;
  }
  CudaGroupState& st = state_for(call, devices);
  std::lock_guard<std::mutex> lock(st.mu);
  const int64_t seq = st.seq + 1;
  cuda::CudaExecutor& ex = executor_for(st, call, seq);
  st.seq = seq;
  auto streams_of = [&](int r) {
    return static_cast<int>(std::max<size_t>(1, ex.program(r).streams.size()));
  };
  for (int r = 0; r < N; ++r) {  // handoff in: nothing of call seq before XLA's stream got here
    TIDE_CHECK_CUDA(cudaSetDevice(devices[static_cast<size_t>(r)]));
    auto ready = static_cast<cudaEvent_t>(call.ranks[static_cast<size_t>(r)]->ready);
    for (int s = 0; s < streams_of(r); ++s)
      TIDE_CHECK_CUDA(cudaStreamWaitEvent(ex.stream(r, s), ready, 0), "rank ", r, " stream ", s);
  }
  ex.run(seq, buffers_for(call));
  if (sync_every_call()) ex.synchronize();
  const int b_ag = dtype_size(call.plan->sig.ag_dtype);
  for (int r = 0; r < N; ++r) {  // handoff out
    TIDE_CHECK_CUDA(cudaSetDevice(devices[static_cast<size_t>(r)]));
    cudaStream_t s0 = ex.stream(r, 0);
    for (int s = 1; s < streams_of(r); ++s) {
      cudaEvent_t j = st.joined[static_cast<size_t>(r)][static_cast<size_t>(s - 1)];
      TIDE_CHECK_CUDA(cudaEventRecord(j, ex.stream(r, s)), "rank ", r, " stream ", s);
      TIDE_CHECK_CUDA(cudaStreamWaitEvent(s0, j, 0), "rank ", r, " stream ", s);
    }
    if (call.spec.op == Collective::kAllGather) {
      // The one copy of the XLA face: rank r's landing rows [0, D_p) -> XLA result p.
      const RankIo& io = *call.ranks[static_cast<size_t>(r)];
      const char* ring = st.fabric->arena(r) +
                         ex.program(r).arena.offset[static_cast<int>(BufKind::kRing0)];
      std::vector<cuda::CopyDesc> copies;
      for (int p = 0; p < lay.P; ++p) {
        const ParamLayout& pl = lay.params[p];
        const size_t bytes = static_cast<size_t>(pl.D * pl.K * b_ag);
        if (bytes > 0) copies.push_back({io.out[p], ring + pl.o * lay.N, bytes, 1, bytes, bytes});
      }
      if (!copies.empty()) cuda::submit_copies(s0, copies.data(), copies.size());
    }
    TIDE_CHECK_CUDA(cudaEventRecord(st.done[static_cast<size_t>(r)], s0), "rank ", r);
  }
}

void CompleteRankCuda(const GroupCall& call, int rank) {
  const RankIo& io = *call.ranks.at(static_cast<size_t>(rank));
  std::vector<int> devices;
  for (const RankIo* x : call.ranks) devices.push_back(x->device);
  CudaGroupState& st = state_for(call, devices);
  TIDE_CHECK(static_cast<size_t>(rank) < st.done.size(), "rank ", rank, ": group never ran");
  DeviceGuard guard;
  TIDE_CHECK_CUDA(cudaSetDevice(io.device), "device ", io.device);
  TIDE_CHECK_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(io.stream),
                                      st.done[static_cast<size_t>(rank)], 0),
                  "XLA stream of rank ", rank);
}

}  // namespace tide::xla_ffi

#endif  // TIDE_WITH_CUDA
