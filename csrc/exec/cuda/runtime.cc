// Driver entry points, stream memory operations, copy paths, stream pool, watchdog.
#include "exec/cuda/runtime.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "exec/cuda/kernels.h"
#include "tide/errors.h"

namespace tide::cuda {

// ---- driver entry points ---------------------------------------------------------------------
namespace {

template <typename Fn>
void resolve(const char* name, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  // 12000: the v2 stream memory operations (CUDA >= 12.0 ABI); the name is the unversioned one.
  TIDE_CHECK_CUDA(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q),
                  "resolving ", name);
  if (q != cudaDriverEntryPointSuccess || fn == nullptr)
    throw ::tide::Error(TIDE_STR_CAT("driver entry point ", name, " not found (status ",
                                     static_cast<int>(q), ")"));
  *out = reinterpret_cast<Fn>(fn);
}

DriverApi load_driver() {
  DriverApi d;
  resolve("cuStreamWriteValue64", &d.stream_write_value64);
  resolve("cuStreamWaitValue64", &d.stream_wait_value64);
  resolve("cuStreamBatchMemOp", &d.stream_batch_mem_op);
  resolve("cuDeviceGetAttribute", &d.device_get_attribute);
  resolve("cuGetErrorName", &d.get_error_name);
  return d;
}

}  // namespace

const DriverApi& driver() {
  static const DriverApi api = load_driver();  // thread-safe one-time init; throws on failure
  return api;
}

void check_cu(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = "?";
  if (driver().get_error_name) driver().get_error_name(r, &name);
  throw ::tide::Error(TIDE_STR_CAT("CUDA driver error ", name, " (", static_cast<int>(r), ") in ", what));
}

namespace {
// The multicast gate's environment, read once per process (the one place it is read).
struct GateEnv {
  bool enable = false, symm_disabled = false;
  std::string nvls;
  bool nvls_set = false;
};
const GateEnv& gate_env() {
  static const GateEnv env = [] {
    GateEnv e;
    const char* enable = std::getenv("TIDE_ENABLE_MULTICAST");
    e.enable = enable && std::strcmp(enable, "1") == 0;
    if (const char* nvls = std::getenv("NCCL_NVLS_ENABLE")) e.nvls = nvls, e.nvls_set = true;
    e.symm_disabled = std::getenv("TORCH_SYMM_MEM_DISABLE_MULTICAST") != nullptr;
    return e;
  }();
  return env;
}
}  // namespace

const char* nccl_nvls_setting() { return gate_env().nvls_set ? gate_env().nvls.c_str() : nullptr; }

bool multicast_allowed(int device) {
  const GateEnv& env = gate_env();
  if (!env.enable) return false;
  if (!env.nvls_set || env.nvls == "0") return false;
  if (env.symm_disabled) return false;
  int supported = 0;
  check_cu(driver().device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,
                                         static_cast<CUdevice>(device)),
           "cuDeviceGetAttribute(MULTICAST_SUPPORTED)");
  return supported == 1;
}

// ---- signals and waits -------------------------------------------------------------------------
void signal(cudaStream_t stream, uint64_t* counter, uint64_t value) {
  check_cu(driver().stream_write_value64(reinterpret_cast<CUstream>(stream),
                                         reinterpret_cast<CUdeviceptr>(counter), value,
                                         CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue64 (SIGNAL)");
}

namespace {
// n stream memory operations in batches of at most 255 (cuStreamBatchMemOp takes < 256), each
// filled by set(op, i); the driver runs a batch in array order.
template <class Set>
void batch_mem_ops(cudaStream_t stream, size_t n, const char* what, Set&& set) {
  constexpr size_t kMaxBatch = 255;
  CUstreamBatchMemOpParams ops[kMaxBatch];
  for (size_t i0 = 0; i0 < n; i0 += kMaxBatch) {
    const size_t m = std::min(kMaxBatch, n - i0);
    for (size_t i = 0; i < m; ++i) {
      ops[i] = CUstreamBatchMemOpParams{};
      set(ops[i], i0 + i);
    }
    check_cu(driver().stream_batch_mem_op(reinterpret_cast<CUstream>(stream), static_cast<unsigned>(m), ops, 0), what);
  }
}
}  // namespace

void signal_all(cudaStream_t stream, const CounterWrite* writes, size_t n) {
  if (n == 1) return signal(stream, writes[0].counter, writes[0].value);
  batch_mem_ops(stream, n, "cuStreamBatchMemOp (WRITE_VALUE_64: SIGNAL/CREDIT)", [&](CUstreamBatchMemOpParams& op, size_t i) {
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op.writeValue.address = reinterpret_cast<CUdeviceptr>(writes[i].counter);
    op.writeValue.value64 = writes[i].value;
    op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  });
}

void wait_geq(cudaStream_t stream, const WaitSpec* specs, size_t n) {
  batch_mem_ops(stream, n, "cuStreamBatchMemOp (WAIT_VALUE_64 GEQ)", [&](CUstreamBatchMemOpParams& op, size_t i) {
    op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    op.waitValue.address = reinterpret_cast<CUdeviceptr>(specs[i].counter);
    op.waitValue.value64 = specs[i].value;
    op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  });
}

// ---- copies ------------------------------------------------------------------------------------
bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  TIDE_CHECK_CUDA(cudaStreamIsCapturing(stream, &st));
  return st != cudaStreamCaptureStatusNone;
}

void submit_copies(cudaStream_t stream, const ResolvedCopy* d, size_t n, Copy2D mode) {
  if (n == 0) return;
  const bool capturing = stream_is_capturing(stream);
  // The batch APIs refuse (and on some drivers crash on) the legacy NULL stream and the
  // per-thread default stream, and cannot be captured: those get per-copy calls.
  const bool default_stream = stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
  const bool batch = !capturing && !default_stream;
  const bool batch_2d = batch && mode == Copy2D::kBatch;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  std::vector<cudaMemcpy3DBatchOp> ops2d;
  for (size_t i = 0; i < n; ++i) {
    const ResolvedCopy& c = d[i];
    if (c.width == 0 || c.height == 0) continue;
    if (c.height == 1 && batch) {
      dsts.push_back(c.dst);
      srcs.push_back(c.src);
      sizes.push_back(c.width);
    } else if (c.height == 1) {
      TIDE_CHECK_CUDA(cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDeviceToDevice, stream),
                      "COPY ", i, capturing ? " (captured)" : " (default stream)");
    } else if (batch_2d) {
      cudaMemcpy3DBatchOp op{};
      op.src.type = cudaMemcpyOperandTypePointer;
      op.src.op.ptr.ptr = const_cast<void*>(c.src);
      op.src.op.ptr.rowLength = c.spitch;  // elements of one byte: the pitch
      op.dst.type = cudaMemcpyOperandTypePointer;
      op.dst.op.ptr.ptr = c.dst;
      op.dst.op.ptr.rowLength = c.dpitch;
      op.extent.width = c.width;
      op.extent.height = c.height;
      op.extent.depth = 1;
      op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      op.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      ops2d.push_back(op);
    } else {
      TIDE_CHECK_CUDA(cudaMemcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height,
                                        cudaMemcpyDeviceToDevice, stream),
                      "COPY ", i, " (2-D, ", c.width, "x", c.height, ")");
    }
  }
  if (!ops2d.empty())
    TIDE_CHECK_CUDA(cudaMemcpy3DBatchAsync(ops2d.size(), ops2d.data(), 0, stream), "COPY 2-D batch of ",
                    ops2d.size());
  if (dsts.empty()) return;
  if (dsts.size() == 1) {
    TIDE_CHECK_CUDA(cudaMemcpyAsync(dsts[0], srcs[0], sizes[0], cudaMemcpyDeviceToDevice, stream), "COPY (one)");
    return;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
  TIDE_CHECK_CUDA(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr,
                                       &attr_idx, 1, stream),
                  "COPY batch of ", dsts.size());
}

void submit_copies_on_sms(cudaStream_t stream, const ResolvedCopy* d, size_t n, int ctas) {
  SmCopyArgs a;
  auto flush = [&] {
    launch_sm_copies(a, ctas, stream);
    a.n = 0;
  };
  for (size_t i = 0; i < n; ++i) {
    const ResolvedCopy& c = d[i];
    if (c.width == 0 || c.height == 0) continue;
    if (a.n == kMaxSmCopies) flush();
    const auto w = static_cast<int64_t>(c.width), h = static_cast<int64_t>(c.height);
    const auto dp = static_cast<int64_t>(c.dpitch), sp = static_cast<int64_t>(c.spitch);
    a.copies[a.n++] = {static_cast<char*>(c.dst), static_cast<const char*>(c.src), w, h, dp, sp,
                       sm_copy_vec(c.dst, c.src, w, h, dp, sp), 0};
  }
  if (a.n > 0) flush();
}

// ---- copy lanes ---------------------------------------------------------------------------------
CopyLanes::CopyLanes(int device, int n, size_t spread_bytes, Copy2D mode)
    : device_(device), spread_bytes_(spread_bytes), mode_(mode) {
  TIDE_CHECK(n >= 2, "copy lanes: ", n, " (need at least 2)");
  DeviceGuard guard(device, "copy lanes: ");
  try {
    TIDE_CHECK_CUDA(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "copy lanes: fork event");
    for (int i = 0; i < n; ++i) {
      cudaStream_t s = nullptr;
      cudaEvent_t e = nullptr;
      TIDE_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "copy lane ", i);
      lanes_.push_back(s);
      TIDE_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "copy lane ", i, " join event");
      join_.push_back(e);
    }
  } catch (...) {
    release();
    throw;
  }
}

CopyLanes::~CopyLanes() {
  cudaSetDevice(device_);
  release();
}

void CopyLanes::release() noexcept {
  for (auto s : lanes_) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  for (auto e : join_) cudaEventDestroy(e);
  if (fork_) cudaEventDestroy(fork_);
  lanes_.clear();
  join_.clear();
  fork_ = nullptr;
}

void CopyLanes::submit(cudaStream_t origin, const ResolvedCopy* d, size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  auto bytes = [&](size_t i) { return d[i].width * d[i].height; };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes(a) > bytes(b); });
  const size_t k = lanes_.size();
  std::vector<std::vector<ResolvedCopy>> part(k);
  std::vector<size_t> load(k, 0);
  for (size_t i : order) {
    const size_t l = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    part[l].push_back(d[i]);
    load[l] += bytes(i);
  }
  TIDE_CHECK_CUDA(cudaEventRecord(fork_, origin), "copy lanes: fork");
  for (size_t l = 0; l < k; ++l) {
    if (part[l].empty()) continue;
    TIDE_CHECK_CUDA(cudaStreamWaitEvent(lanes_[l], fork_, 0), "copy lane ", l, ": fork");
    submit_copies(lanes_[l], part[l].data(), part[l].size(), mode_);
    TIDE_CHECK_CUDA(cudaEventRecord(join_[l], lanes_[l]), "copy lane ", l, ": join");
    TIDE_CHECK_CUDA(cudaStreamWaitEvent(origin, join_[l], 0), "copy lane ", l, ": join");
  }
}

void submit_copies(cudaStream_t stream, const ResolvedCopy* d, size_t n, CopyLanes* lanes, Copy2D mode) {
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) total += d[i].width * d[i].height;
  if (lanes && n >= 2 && total >= lanes->spread_bytes()) lanes->submit(stream, d, n);
  else submit_copies(stream, d, n, mode);
}

CopyLanes* CopyLaneTable::for_op(int rank, int stream, int device, size_t n, size_t bytes) {
  if (lanes_ <= 1 || n < 2 || bytes < spread_bytes_) return nullptr;
  auto& slot = table_[{rank, stream}];
  if (!slot) slot = std::make_unique<CopyLanes>(device, lanes_, spread_bytes_, mode_);
  return slot.get();
}

// ---- current device ------------------------------------------------------------------------------
DeviceGuard::DeviceGuard(int device, const char* who) {
  if (cudaGetDevice(&prev_) != cudaSuccess) {
    cudaGetLastError();
    prev_ = -1;
  }
  TIDE_CHECK_CUDA(cudaSetDevice(device), who, "device ", device);
}

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

// ---- stream pool -------------------------------------------------------------------------------
// ---- watchdog ----------------------------------------------------------------------------------
Watchdog::Watchdog(int device, double timeout_s) : device_(device), timeout_s_(timeout_s) {
  TIDE_CHECK_CUDA(cudaSetDevice(device));
  TIDE_CHECK_CUDA(cudaStreamCreateWithFlags(&rescue_, cudaStreamNonBlocking));
  thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  cudaSetDevice(device_);
  for (std::vector<Entry>* v : {&active_, &entries_})
    for (auto& e : *v) release(e);  // never leave a stream blocked on a wait nobody will satisfy
  // [Note: late work]: an abort still running ends here (the releases above let its stream go),
  // never after its executor, nor on a thread that outlives the process's interpreter.
  for (auto& t : late_) t.join();
  for (std::vector<Entry>* v : {&active_, &entries_})
    for (auto& e : *v) cudaEventDestroy(e.done);
  for (auto& [dev, evs] : free_events_)
    for (auto ev : evs) cudaEventDestroy(ev);
  cudaStreamSynchronize(rescue_);
  cudaStreamDestroy(rescue_);
}

void Watchdog::watched_wait(cudaStream_t stream, const WaitSpec* specs, size_t n,
                            const std::string& what, double timeout_s) {
  // One watchdog may watch streams of several devices (an in-process executor over several
  // GPUs); the event must belong to the stream's device.
  int dev = 0;
  TIDE_CHECK_CUDA(cudaStreamGetDevice(stream, &dev), "watchdog: device of the stream for ", what);
  wait_geq(stream, specs, n);
  Entry e;
  e.specs.assign(specs, specs + n);
  e.what = what;
  watch(stream, dev, std::move(e), timeout_s > 0 ? timeout_s : timeout_s_);
}

void Watchdog::watched_waits(cudaStream_t stream, int device, const WaitSpec* specs, size_t n,
                             std::shared_ptr<const WaitLabels> labels, int64_t seq, double timeout_s) {
  wait_geq(stream, specs, n);
  Entry e;
  e.specs.assign(specs, specs + n);
  e.labels = std::move(labels);
  e.seq = seq;
  watch(stream, device, std::move(e), timeout_s > 0 ? timeout_s : timeout_s_);
}

void Watchdog::watched_work(cudaStream_t stream, const std::string& what, std::function<void()> on_timeout,
                            double timeout_s) {
  int dev = 0;
  TIDE_CHECK_CUDA(cudaStreamGetDevice(stream, &dev), "watchdog: device of the stream for ", what);
  Entry e;
  e.what = what;
  e.on_timeout = std::move(on_timeout);
  watch(stream, dev, std::move(e), timeout_s > 0 ? timeout_s : timeout_s_);
}

void Watchdog::watch(cudaStream_t stream, int dev, Entry e, double limit) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto& pool = free_events_[dev];
    if (!pool.empty()) {
      ev = pool.back();
      pool.pop_back();
    }
  }
  if (!ev) {
    DeviceGuard on(dev, "watchdog event: ");
    TIDE_CHECK_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  }
  const cudaError_t rec = cudaEventRecord(ev, stream);
  if (rec != cudaSuccess) {
    {
      std::lock_guard<std::mutex> g(mu_);
      free_events_[dev].push_back(ev);
    }
    TIDE_CHECK_CUDA(rec, "watchdog event for ", e.describe());
  }
  e.done = ev;
  e.stream = stream;
  e.device = dev;
  e.deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(static_cast<int64_t>(limit * 1e6));
  bool wake = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    entries_.push_back(std::move(e));
    ++pending_;
    wake = idle_;  // a busy thread takes it on its next pass (<= 200 us)
  }
  if (wake) cv_.notify_all();
}

void Watchdog::release(const Entry& e) {
  for (const auto& s : e.specs) {
    // Fail-stop release: satisfy the stuck wait so the stream drains (values stay monotone:
    // the counter is below s.value while the wait is stuck).
    driver().stream_write_value64(reinterpret_cast<CUstream>(rescue_),
                                  reinterpret_cast<CUdeviceptr>(s.counter), s.value,
                                  CU_STREAM_WRITE_VALUE_DEFAULT);
  }
}

void Watchdog::loop() {
  register_dump_thread(true);
  cudaSetDevice(device_);
  std::unique_lock<std::mutex> lk(mu_);
  std::vector<std::pair<int, cudaEvent_t>> freed;  // returned to the pools under mu_
  std::vector<cudaStream_t> behind;                // streams with an unfinished entry this pass
  std::string first_error;
  while (!stop_) {
    for (auto& e : entries_) active_.push_back(std::move(e));
    entries_.clear();
    if (active_.empty()) {
      idle_ = true;
      cv_.wait(lk);
      idle_ = false;
      continue;
    }
    lk.unlock();
    // The pass, without the lock ([Note: watchdog and fail-stop]).
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::function<void()>> late_work;  // run after every overdue wait is released
    size_t removed = 0;
    behind.clear();
    first_error.clear();
    size_t keep = 0;  // active_[0, keep): still watched, in registration order
    for (size_t i = 0; i < active_.size(); ++i) {
      Entry& e = active_[i];
      // Events on one stream complete in order: behind an unfinished entry, only the deadline is
      // looked at (and the event queried when it is past, so a finished entry never times out).
      const bool skip = std::find(behind.begin(), behind.end(), e.stream) != behind.end() && now <= e.deadline;
      const cudaError_t q = skip ? cudaErrorNotReady : cudaEventQuery(e.done);
      if (q == cudaSuccess) {
        freed.emplace_back(e.device, e.done);
        ++removed;
        continue;
      }
      if (!skip) behind.push_back(e.stream);
      if (q != cudaErrorNotReady) {
        if (first_error.empty())
          first_error = TIDE_STR_CAT("CUDA error ", cudaGetErrorName(q), " while watching ", e.describe());
        ++removed;  // its event is unusable
        continue;
      }
      if (now > e.deadline) {
        if (first_error.empty()) first_error = TIDE_STR_CAT("timeout: ", e.describe(), " never saw its producer (fail-stop)");
        release(e);
        if (e.on_timeout) late_work.push_back(std::move(e.on_timeout));
        e.on_timeout = nullptr;
        e.deadline = now + std::chrono::hours(24);  // released once
      }
      if (keep != i) active_[keep] = std::move(e);
      ++keep;
    }
    active_.resize(keep);
    // [Note: late work] An overdue rail group's abort (ncclCommAbort) may wait for its stream,
    // which may sit behind a stuck wait this loop releases: it runs on a thread of its own, after
    // the rescue writes of this pass, so neither waits for the other. The threads are joined by
    // the destructor, never detached: a detached one could outlive its executor (the replayed
    // graphs it aborts) and drop the last reference to a face's object (a Python NcclRail)
    // while the interpreter finalizes, which terminates the process.
    for (auto& f : late_work) late_.emplace_back(std::move(f));
    lk.lock();
    for (auto& [dev, ev] : freed) free_events_[dev].push_back(ev);
    freed.clear();
    pending_ -= removed;
    if (!first_error.empty() && error_.empty()) error_ = first_error;
    cv_.notify_all();  // drain()
    cv_.wait_for(lk, std::chrono::microseconds(200));
  }
  register_dump_thread(false);
}

void Watchdog::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [this] { return pending_ == 0 || stop_; });
  if (!error_.empty()) {
    std::string m;
    m.swap(error_);
    throw ::tide::TimeoutError(m);
  }
}

void Watchdog::check() {
  std::lock_guard<std::mutex> g(mu_);
  if (!error_.empty()) {
    std::string m;
    m.swap(error_);
    throw ::tide::TimeoutError(m);
  }
}

}  // namespace tide::cuda
