// Bindings for csrc/exec/cuda and csrc/fabric: the submodule tide._core.cuda (raw device
// primitives for tests, benches and sanitizer cases; the fabrics and CUDA executors are bound in
// bind_cuda_exec.cc) and tide._core.testing. Without CUDA the module still imports and
// tide._core.cuda.available() is False.
//
// Framework-neutral: device buffers cross as integer addresses (torch `data_ptr()`, DLPack,
// cupy `.data.ptr`) and streams as integer handles (`torch.cuda.Stream.cuda_stream`); 0 is the
// legacy default stream. The caller keeps every buffer alive until the stream has finished.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "python/bind_common.h"
#include "tide/errors.h"
#include "tide/plan.h"

namespace nb = nanobind;

#ifdef TIDE_WITH_CUDA
#include "exec/cuda/kernels.h"
#include "exec/cuda/probe.h"
#include "exec/cuda/runtime.h"
namespace {
using namespace tide::cuda;
template <typename T>
T* ptr(uint64_t a) { return reinterpret_cast<T*>(static_cast<uintptr_t>(a)); }
cudaStream_t strm(uint64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }

std::vector<WaitSpec> specs_of(const std::vector<std::pair<uint64_t, uint64_t>>& w) {
  std::vector<WaitSpec> v;
  for (auto& [p, val] : w) v.push_back({ptr<const uint64_t>(p), val});
  return v;
}

// cuda_copies' lanes, per (device, count), for the life of the process (never destroyed: CUDA
// may be torn down before static destructors run). Their fork/join events are shared: one host
// thread at a time (benches and tests; the executors own their lanes).
CopyLanes* lanes_for(int lanes) {
  if (lanes <= 1) return nullptr;
  static std::mutex mu;
  static std::map<std::pair<int, int>, CopyLanes*> table;
  int dev = 0;
  TIDE_CHECK_CUDA(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  CopyLanes*& l = table[{dev, lanes}];
  if (!l) l = new CopyLanes(dev, lanes, size_t{8} << 20);
  return l;
}

LaunchKnobs knobs_from(nb::object options) { return launch_knobs(tide::options_from_python(options)); }

// A device copy of a host table (SUM segments, REDUCE runs) for the raw launches: the core packs
// its own structs, Python hands over plain tuples.
class DeviceTable {
 public:
  DeviceTable(const void* host, size_t bytes, int64_t count) : count_(count), bytes_(bytes) {
    TIDE_CHECK_CUDA(cudaGetDevice(&device_));
    if (bytes > 0) {
      TIDE_CHECK_CUDA(cudaMalloc(&ptr_, bytes), "device table of ", bytes, " bytes");
      TIDE_CHECK_CUDA(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice), "uploading a device table");
    }
  }
  ~DeviceTable() {
    if (ptr_) {
      cudaSetDevice(device_);
      cudaFree(ptr_);
    }
  }
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;
  uint64_t ptr() const { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr_)); }
  int64_t count() const { return count_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  int64_t count_ = 0;
  size_t bytes_ = 0;
  int device_ = 0;
};

void bind_cuda_ops(nb::module_& m) {
  nb::class_<DeviceTable>(m, "DeviceTable", "A table the core packed, on the current device.")
      .def_prop_ro("ptr", &DeviceTable::ptr)
      .def_prop_ro("count", &DeviceTable::count)
      .def_prop_ro("bytes", &DeviceTable::bytes);
  m.def("sum_segments", [](const std::vector<std::tuple<int64_t, int64_t, int64_t, int>>& rows) {
    std::vector<SumSegment> v;
    for (const auto& [d, ln, s, p] : rows) v.push_back({d, ln, s, p, 0});
    return new DeviceTable(v.data(), v.size() * sizeof(SumSegment), static_cast<int64_t>(v.size()));
  }, nb::arg("rows"), "SUM's segment table on the current device: rows (dst_off, len, src_off, param), param < 0 "
     "for zero padding.");
  m.def("reduce_runs", [](const nb::list& runs) {
    std::vector<ReduceRun> v;
    for (auto item : runs) {
      nb::sequence run = nb::borrow<nb::sequence>(item);
      TIDE_PLAN_CHECK(nb::len(run) == 3, "reduce_runs: a run is (dst_off, len, terms)");
      ReduceRun r{};
      r.dst_off = nb::cast<int64_t>(run[0]);
      r.len = nb::cast<int64_t>(run[1]);
      for (auto& sl : r.slot) sl = -1;
      int i = 0;
      for (auto t : nb::borrow<nb::sequence>(run[2])) {
        TIDE_PLAN_CHECK(i < kMaxTerms, "reduce_runs: at most ", kMaxTerms, " terms");
        if (!t.is_none()) {
          nb::sequence st = nb::borrow<nb::sequence>(t);
          r.slot[i] = static_cast<int16_t>(nb::cast<int>(st[0]));
          r.off[i] = nb::cast<int64_t>(st[1]);
        }
        ++i;
      }
      v.push_back(r);
    }
    return new DeviceTable(v.data(), v.size() * sizeof(ReduceRun), static_cast<int64_t>(v.size()));
  }, nb::arg("runs"), "REDUCE's run table on the current device: runs (dst_off, len, terms), terms[i] = (slot, "
     "byte offset) or None (absent).");
  m.def("sum",
        [](uint64_t dst, int64_t n, const std::vector<uint64_t>& staged, uint64_t segs, int n_segs,
           const std::vector<uint64_t>& grads, int ctas, uint64_t stream, nb::object options, bool fp16) {
          TIDE_PLAN_CHECK(staged.size() <= static_cast<size_t>(kMaxStaged), "staged: at most ", kMaxStaged);
          TIDE_PLAN_CHECK(grads.size() <= static_cast<size_t>(kMaxGradPtrs), "grads: at most ", kMaxGradPtrs);
          SumArgs a;
          a.dst = ptr<float>(dst);
          a.n = n;
          a.n_staged = static_cast<int>(staged.size());
          for (size_t i = 0; i < staged.size(); ++i) a.staged[i] = ptr<const uint16_t>(staged[i]);
          a.segs = ptr<const SumSegment>(segs);
          a.n_segs = n_segs;
          for (size_t i = 0; i < grads.size(); ++i) a.grad[i] = ptr<const uint16_t>(grads[i]);
          a.fp16 = fp16 ? 1 : 0;
          launch_sum(a, ctas, knobs_from(options), strm(stream));
        },
        nb::arg("dst"), nb::arg("n"), nb::arg("staged"), nb::arg("segs"), nb::arg("n_segs"),
        nb::arg("grads"), nb::arg("ctas"), nb::arg("stream") = 0, nb::arg("options") = nb::none(),
        nb::arg("fp16") = false,
        "SUM: dst[k] = ((staged_0 + staged_1) + ...) + own, fp32. `segs` is a device table of "
        "int64 rows (dst_off, len, src_off, param) with param < 0 for zero padding. options: the "
        "executor options the launch follows (cta_split, full_grid). fp16: operands are fp16, not bf16.");
  m.def("reduce",
        [](uint64_t dst, int64_t n, uint64_t runs, int n_runs, int n_terms, uint32_t fp32_terms, bool land,
           bool accumulate, float alpha, const std::vector<uint64_t>& bases, int ctas, uint64_t stream,
           nb::object options, uint32_t fp16_terms) {
          TIDE_PLAN_CHECK(bases.size() <= static_cast<size_t>(kMaxSlots), "bases: at most ", kMaxSlots, " slots");
          ReduceArgs a;
          a.dst = ptr<float>(dst);
          a.n = n;
          a.runs = ptr<const ReduceRun>(runs);
          a.n_runs = n_runs;
          a.n_terms = n_terms;
          a.fp32_terms = fp32_terms;
          a.fp16_terms = fp16_terms;
          a.land = land ? 1 : 0;
          a.accumulate = accumulate ? 1 : 0;
          a.alpha = alpha;
          for (size_t i = 0; i < bases.size(); ++i) a.base[i] = ptr<const void>(bases[i]);
          launch_reduce(a, ctas, knobs_from(options), strm(stream));
        },
        nb::arg("dst"), nb::arg("n"), nb::arg("runs"), nb::arg("n_runs"), nb::arg("n_terms"),
        nb::arg("fp32_terms"), nb::arg("land"), nb::arg("accumulate"), nb::arg("alpha"), nb::arg("bases"),
        nb::arg("ctas"), nb::arg("stream") = 0, nb::arg("options") = nb::none(), nb::arg("fp16_terms") = 0,
        "REDUCE (the executor's SUM/LAND kernel) over a device run table (tide._core.cuda.reduce_runs, or the run "
        "table an executor builds from a program's op); `bases[slot]` are the slot base addresses; a term in "
        "neither fp32_terms nor fp16_terms is bf16.");
  m.def("resident_ctas_per_sm", &resident_ctas_per_sm, nb::arg("kernel"), nb::arg("n_staged") = 0,
        "CTAs of SUM ('sum', L-1 = n_staged) or REDUCE ('reduce' / 'reduce_fp32', bf16 / fp32 terms) resident "
        "on one SM (occupancy API).");
  m.def("split_for", [](int ctas, nb::object options) {
          return std::string(split_for(ctas, knobs_from(options)) == kSplitRanges ? "ranges" : "tiles");
        }, nb::arg("ctas"), nb::arg("options") = nb::none(),
        "How SUM and REDUCE split their elements over `ctas` CTAs under `options` (cta_split): 'tiles' or 'ranges'.");
  m.def("install_stack_dump", &install_stack_dump, nb::arg("signum"),
        "On signal `signum`, write the receiving thread's and every executor watchdog's native "
        "backtrace to stderr (hang reports where gdb is missing; tests/test_cuda_ipc.py).");
  m.def("kernel_attrs", []() {
    nb::list out;
    for (const KernelAttrs& k : sum_kernel_attrs()) {
      nb::dict d;
      d["name"] = k.name; d["regs"] = k.regs; d["local_bytes"] = k.local_bytes;
      d["static_smem"] = k.static_smem; d["max_threads"] = k.max_threads;
      out.append(d);
    }
    return out;
  }, "Registers and local memory (spills + stack) of every SUM/REDUCE kernel (cudaFuncGetAttributes).");
  m.def("cast",
        [](uint64_t dst, uint64_t src, int64_t n, int ctas, uint64_t stream, const std::string& to) {
          const tide::DType t = tide::parse_dtype(to, "cast: to");
          TIDE_PLAN_CHECK(t == tide::DType::kBF16 || t == tide::DType::kFP16, "cast: to must be bfloat16 or float16, got ", to);
          launch_cast(ptr<uint16_t>(dst), ptr<const float>(src), n, ctas, strm(stream), t == tide::DType::kFP16);
        },
        nb::arg("dst"), nb::arg("src"), nb::arg("n"), nb::arg("ctas") = 132, nb::arg("stream") = 0,
        nb::arg("to") = "bfloat16", "CAST: fp32 -> bf16 (or fp16), round to nearest even.");
  m.def("zero",
        [](const std::vector<std::pair<uint64_t, int64_t>>& regions, int ctas, uint64_t stream) {
          TIDE_PLAN_CHECK(regions.size() <= static_cast<size_t>(kMaxZeroRegions), "at most ", kMaxZeroRegions, " regions");
          ZeroArgs a;
          a.n_regions = static_cast<int>(regions.size());
          for (size_t i = 0; i < regions.size(); ++i) a.regions[i] = {ptr<void>(regions[i].first), regions[i].second};
          launch_zero(a, ctas, strm(stream));
        },
        nb::arg("regions"), nb::arg("ctas") = 8, nb::arg("stream") = 0, "ZERO: clear (ptr, bytes) regions.");
  m.def("copies",
        [](const std::vector<std::tuple<uint64_t, uint64_t, size_t, size_t, size_t, size_t>>& d,
           uint64_t stream, int lanes, const std::string& copy_2d, int sm_ctas) {
          std::vector<ResolvedCopy> v;
          v.reserve(d.size());
          for (auto& [dst, src, w, h, dp, sp] : d) v.push_back({ptr<void>(dst), ptr<const void>(src), w, h, dp, sp});
          TIDE_PLAN_CHECK(lanes >= 1 && lanes <= 8, "cuda.copies: lanes must be in [1, 8], got ", lanes);
          tide::ExecutorOptions o;
          tide::set_option(o, "copy_2d", copy_2d, "cuda.copies");
          if (sm_ctas > 0) {
            tide::set_option(o, "copy_ctas", std::to_string(sm_ctas), "cuda.copies: sm_ctas");
            submit_copies_on_sms(strm(stream), v.data(), v.size(), o.copy_ctas);
            return;
          }
          submit_copies(strm(stream), v.data(), v.size(), lanes_for(lanes), o.copy_2d);
        },
        nb::arg("descs"), nb::arg("stream") = 0, nb::arg("lanes") = 1, nb::arg("copy_2d") = "batch",
        nb::arg("sm_ctas") = 0,
        "COPY: (dst, src, width, height, dpitch, spitch) descriptors; batched when eager (copy_2d: the 2-D "
        "path, batch | per_copy); spread over "
        "`lanes` streams forked from `stream` when the call moves >= 8 MiB (the executors' default "
        "copy_spread_bytes). sm_ctas > 0: on SMs instead, TIDE's copy kernel at that many CTAs "
        "(copies_on=sms).");
  m.def("sm_copy_unit",
        [](uint64_t dst, uint64_t src, int64_t w, int64_t h, int64_t dp, int64_t sp) {
          return sm_copy_vec(ptr<void>(dst), ptr<const void>(src), w, h, dp, sp);
        },
        nb::arg("dst"), nb::arg("src"), nb::arg("width"), nb::arg("height"), nb::arg("dpitch"), nb::arg("spitch"),
        "The unit (bytes) TIDE's copy kernel moves such a copy in: 16, 8, 4, 2 or 1.");
  m.def("signal",
        [](uint64_t counter, uint64_t value, uint64_t stream) { signal(strm(stream), ptr<uint64_t>(counter), value); },
        nb::arg("counter"), nb::arg("value"), nb::arg("stream") = 0);
  m.def("wait",
        [](const std::vector<std::pair<uint64_t, uint64_t>>& w, uint64_t stream) {
          auto v = specs_of(w);
          wait_geq(strm(stream), v.data(), v.size());
        },
        nb::arg("waits"), nb::arg("stream") = 0, "WAIT: stream waits until each *counter >= value.");
  m.def("multicast_allowed", &multicast_allowed, nb::arg("device") = 0,
        "Evaluate the multicast safety gate (never creates a multicast object).");
  // Minimal memory helpers (sanitizer cases and tests that must not load a framework).
  m.def("malloc", [](size_t bytes) {
    void* p = nullptr;
    TIDE_CHECK_CUDA(cudaMalloc(&p, bytes), "cuda_malloc(", bytes, ")");
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
  });
  m.def("free", [](uint64_t p) { TIDE_CHECK_CUDA(cudaFree(ptr<void>(p))); });
  m.def("h2d", [](uint64_t dst, nb::bytes data) {
    TIDE_CHECK_CUDA(cudaMemcpy(ptr<void>(dst), data.c_str(), data.size(), cudaMemcpyHostToDevice));
  });
  m.def("d2h", [](uint64_t src, size_t n) {
    std::string out(n, '\0');
    TIDE_CHECK_CUDA(cudaMemcpy(out.data(), ptr<const void>(src), n, cudaMemcpyDeviceToHost));
    return nb::bytes(out.data(), out.size());
  });
  m.def("memset", [](uint64_t dst, int value, size_t bytes, uint64_t stream) {
    TIDE_CHECK_CUDA(cudaMemsetAsync(ptr<void>(dst), value, bytes, strm(stream)), "cuda_memset");
  }, nb::arg("dst"), nb::arg("value"), nb::arg("bytes"), nb::arg("stream") = 0);
  m.def("synchronize", []() { TIDE_CHECK_CUDA(cudaDeviceSynchronize(), "cuda_synchronize"); },
        nb::call_guard<nb::gil_scoped_release>());
  m.def("capabilities", [](int device) {
    const Capabilities c = probe_capabilities(device);
    nb::dict d;
    d["device"] = c.device; d["name"] = c.name; d["cc"] = nb::make_tuple(c.cc_major, c.cc_minor);
    d["sm_count"] = c.sm_count; d["async_engines"] = c.async_engines; d["smem_optin"] = c.smem_optin;
    d["l2_bytes"] = c.l2_bytes; d["memops64"] = c.memops64;
    d["multicast_supported"] = c.multicast_supported; d["multicast_allowed"] = c.multicast_allowed;
    return d;
  }, nb::arg("device") = 0, "Capability probe (ranks compare these; multicast fields only report).");
  m.def("is_capturing", [](uint64_t stream) { return stream_is_capturing(strm(stream)); });

  nb::class_<Watchdog>(m, "Watchdog")
      .def(nb::init<int, double>(), nb::arg("device"), nb::arg("timeout_s"))
      .def("wait",
           [](Watchdog& w, const std::vector<std::pair<uint64_t, uint64_t>>& waits, const std::string& what,
              uint64_t stream) {
             auto v = specs_of(waits);
             w.watched_wait(strm(stream), v.data(), v.size(), what);
           },
           nb::arg("waits"), nb::arg("what"), nb::arg("stream") = 0)
      .def("drain", &Watchdog::drain, nb::call_guard<nb::gil_scoped_release>())
      .def("check", &Watchdog::check);
}
}  // namespace
void bind_cuda_exec(nb::module_& m, nb::module_& testing);  // bind_cuda_exec.cc
void bind_nccl(nb::module_& m);       // bind_nccl.cc
#endif

void bind_cuda(nb::module_& top) {
  nb::module_ m = top.def_submodule("cuda", "TIDE's CUDA side: fabrics, executors and raw device primitives");
  nb::module_ testing = nb::borrow<nb::module_>(top.attr("testing"));  // bind_session.cc made it
  m.def("device_count", []() {
#ifdef TIDE_WITH_CUDA
    return tide::cuda::device_count();
#else
    return 0;
#endif
  }, "Number of usable CUDA devices (0 without a CUDA build, driver or device).");
  m.def("available", []() {
#ifdef TIDE_WITH_CUDA
    return tide::cuda::device_count() > 0;
#else
    return false;
#endif
  }, "True when this build has the CUDA executor and a CUDA device is usable.");
#ifdef TIDE_WITH_CUDA
  m.attr("built") = true;
  bind_cuda_ops(m);
  bind_nccl(m);
  bind_cuda_exec(m, testing);
#else
  m.attr("built") = false;
  // The CUDA names exist without CUDA too, so callers (tide_torch) get a clear error, not an
  // AttributeError.
  m.def("nccl_header_version", []() { return 0; }, "0: this build has no NCCL fabric.");
  for (const char* name : {"IpcFabric", "InProcessFabric", "NcclFabric", "ClusterExecutor", "RankExecutor",
                           "capabilities", "nccl_unique_id", "nccl_version", "nccl_library_path"}) {
    const std::string msg = std::string("tide._core.cuda.") + name +
                            ": this build of tide._core has no CUDA executor (built with TIDE_CUDA=off or "
                            "without nvcc); rebuild with TIDE_CUDA=on on a machine with the CUDA toolkit";
    m.def(name, [msg](nb::args, nb::kwargs) -> nb::object { throw tide::PlanError(msg); });
  }
#endif
}
