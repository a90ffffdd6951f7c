// Bindings for csrc/exec/cuda and csrc/fabric (owner: CUDA executor). Without CUDA this module
// still imports and reports cuda_available() == False.
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

#include "tide/errors.h"

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
  if (!l) l = new CopyLanes(dev, lanes);
  return l;
}

void bind_cuda_ops(nb::module_& m) {
  m.def("cuda_sum",
        [](uint64_t dst, int64_t n, const std::vector<uint64_t>& staged, uint64_t segs, int n_segs,
           const std::vector<uint64_t>& grads, int ctas, uint64_t stream) {
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
          launch_sum(a, ctas, strm(stream));
        },
        nb::arg("dst"), nb::arg("n"), nb::arg("staged"), nb::arg("segs"), nb::arg("n_segs"),
        nb::arg("grads"), nb::arg("ctas"), nb::arg("stream") = 0,
        "SUM: dst[k] = ((staged_0 + staged_1) + ...) + own, fp32. `segs` is a device table of "
        "int64 rows (dst_off, len, src_off, param) with param < 0 for zero padding.");
  m.def("cuda_reduce",
        [](uint64_t dst, int64_t n, uint64_t runs, int n_runs, int n_terms, uint32_t fp32_terms, bool land,
           bool accumulate, float alpha, const std::vector<uint64_t>& bases, int ctas, uint64_t stream) {
          TIDE_PLAN_CHECK(bases.size() <= static_cast<size_t>(kMaxSlots), "bases: at most ", kMaxSlots, " slots");
          ReduceArgs a;
          a.dst = ptr<float>(dst);
          a.n = n;
          a.runs = ptr<const ReduceRun>(runs);
          a.n_runs = n_runs;
          a.n_terms = n_terms;
          a.fp32_terms = fp32_terms;
          a.land = land ? 1 : 0;
          a.accumulate = accumulate ? 1 : 0;
          a.alpha = alpha;
          for (size_t i = 0; i < bases.size(); ++i) a.base[i] = ptr<const void>(bases[i]);
          launch_reduce(a, ctas, strm(stream));
        },
        nb::arg("dst"), nb::arg("n"), nb::arg("runs"), nb::arg("n_runs"), nb::arg("n_terms"),
        nb::arg("fp32_terms"), nb::arg("land"), nb::arg("accumulate"), nb::arg("alpha"), nb::arg("bases"),
        nb::arg("ctas"), nb::arg("stream") = 0,
        "REDUCE (the executor's SUM/LAND kernel): `runs` is a device table of ReduceRun records "
        "(144 bytes: int64 dst_off, len, off[12]; int16 slot[12], pad[4]); `bases[slot]` are the "
        "slot base addresses. Follows TIDE_SUM_KERNEL like cuda_sum.");
  m.def("cuda_resident_ctas_per_sm", &resident_ctas_per_sm, nb::arg("kernel"), nb::arg("n_staged") = 0,
        "CTAs of SUM ('sum', L-1 = n_staged), LAND ('land', sources) or REDUCE ('reduce' / 'reduce_fp32', bf16 / "
        "fp32 terms) resident on one SM (occupancy API).");
  m.def("cuda_copy_2d_batched", &copy_2d_batched,
        "Whether eager 2-D copies go in one cudaMemcpy3DBatchAsync (TIDE_COPY_2D=batch, default) or per copy.");
  m.def("cuda_copy_lanes", &copy_lanes_default, "Copy lanes per issuing stream (TIDE_COPY_LANES, default 4).");
  m.def("cuda_install_stack_dump", &install_stack_dump, nb::arg("signum"),
        "On signal `signum`, write the receiving thread's and every executor watchdog's native "
        "backtrace to stderr (hang reports where gdb is missing; tests/test_cuda_ipc.py).");
  m.def("cuda_cta_split", [](int ctas) {
          const CtaSplit s = ctas > 0 ? cta_split_for(ctas) : cta_split();
          return std::string(s == kCtaRanges ? "ranges" : s == kCtaTiles ? "tiles" : "auto");
        }, nb::arg("ctas") = 0,
        "How SUM, LAND and REDUCE split their elements over a grid of `ctas` CTAs (TIDE_CTA_SPLIT: "
        "auto | tiles | ranges; ctas = 0: the setting itself).");
  m.def("cuda_land_deep", &land_deep,
        "Whether a one-source overwrite LAND keeps 16 vectors per thread in flight (TIDE_LAND_DEEP=1, "
        "default) or 8 (0); same bits.");
  m.def("cuda_full_grid_tiles", &full_grid_tiles,
        "Whether a SUM/LAND/REDUCE budget of a whole resident wave runs one CTA per tile (TIDE_FULL_GRID=tiles, "
        "default) or one wave (wave); same bits (kernels.h [Note: full grid]).");
  m.def("cuda_sum_kernel", []() { return std::string(sum_kernel_name(sum_kernel_effective())); },
        "The SUM/REDUCE variant a launch on the current device runs now (TIDE_SUM_KERNEL, kernels.h).");
  m.def("cuda_sum_kernel_attrs", []() {
    nb::list out;
    for (const KernelAttrs& k : sum_kernel_attrs()) {
      nb::dict d;
      d["name"] = k.name; d["regs"] = k.regs; d["local_bytes"] = k.local_bytes;
      d["static_smem"] = k.static_smem; d["max_threads"] = k.max_threads;
      out.append(d);
    }
    return out;
  }, "Registers and local memory (spills + stack) of every SUM/REDUCE kernel (cudaFuncGetAttributes).");
  m.def("cuda_land",
        [](const std::vector<std::tuple<uint64_t, std::vector<uint64_t>, int64_t>>& jobs, float alpha,
           bool accumulate, int ctas, uint64_t stream) {
          TIDE_PLAN_CHECK(jobs.size() <= static_cast<size_t>(kMaxLandJobs), "jobs: at most ", kMaxLandJobs);
          LandArgs a;
          a.n_jobs = static_cast<int>(jobs.size());
          a.alpha = alpha;
          a.accumulate = accumulate ? 1 : 0;
          for (size_t i = 0; i < jobs.size(); ++i) {
            const auto& [dst, srcs, n] = jobs[i];
            TIDE_PLAN_CHECK(srcs.size() >= 1 && srcs.size() <= static_cast<size_t>(kMaxLandSrcs),
                            "job ", i, ": 1..", kMaxLandSrcs, " sources");
            a.jobs[i].dst = ptr<float>(dst);
            a.jobs[i].n = n;
            a.jobs[i].n_src = static_cast<int>(srcs.size());
            for (size_t k = 0; k < srcs.size(); ++k) a.jobs[i].src[k] = ptr<const float>(srcs[k]);
          }
          launch_land(a, ctas, strm(stream));
        },
        nb::arg("jobs"), nb::arg("alpha") = 1.0f, nb::arg("accumulate") = false, nb::arg("ctas") = 4,
        nb::arg("stream") = 0,
        "LAND: per job (dst, [src...], n): dst = (accumulate ? dst : .) + alpha * ((s0 + s1) + ...).");
  m.def("cuda_cast",
        [](uint64_t dst, uint64_t src, int64_t n, int ctas, uint64_t stream) {
          launch_cast(ptr<uint16_t>(dst), ptr<const float>(src), n, ctas, strm(stream));
        },
        nb::arg("dst"), nb::arg("src"), nb::arg("n"), nb::arg("ctas") = 132, nb::arg("stream") = 0,
        "CAST: fp32 -> bf16, round to nearest even.");
  m.def("cuda_zero",
        [](const std::vector<std::pair<uint64_t, int64_t>>& regions, int ctas, uint64_t stream) {
          TIDE_PLAN_CHECK(regions.size() <= static_cast<size_t>(kMaxZeroRegions), "at most ", kMaxZeroRegions, " regions");
          ZeroArgs a;
          a.n_regions = static_cast<int>(regions.size());
          for (size_t i = 0; i < regions.size(); ++i) a.regions[i] = {ptr<void>(regions[i].first), regions[i].second};
          launch_zero(a, ctas, strm(stream));
        },
        nb::arg("regions"), nb::arg("ctas") = 8, nb::arg("stream") = 0, "ZERO: clear (ptr, bytes) regions.");
  m.def("cuda_copies",
        [](const std::vector<std::tuple<uint64_t, uint64_t, size_t, size_t, size_t, size_t>>& d,
           uint64_t stream, int lanes) {
          std::vector<CopyDesc> v;
          v.reserve(d.size());
          for (auto& [dst, src, w, h, dp, sp] : d) v.push_back({ptr<void>(dst), ptr<const void>(src), w, h, dp, sp});
          TIDE_PLAN_CHECK(lanes >= 1 && lanes <= 8, "cuda_copies: lanes must be in [1, 8], got ", lanes);
          submit_copies(strm(stream), v.data(), v.size(), lanes_for(lanes));
        },
        nb::arg("descs"), nb::arg("stream") = 0, nb::arg("lanes") = 1,
        "COPY: (dst, src, width, height, dpitch, spitch) descriptors; batched when eager; spread over "
        "`lanes` streams forked from `stream` when the call moves >= TIDE_COPY_SPREAD_BYTES (8 MiB; "
        "the executors' rule, read when a process first uses `lanes`).");
  m.def("cuda_signal",
        [](uint64_t counter, uint64_t value, uint64_t stream) { signal(strm(stream), ptr<uint64_t>(counter), value); },
        nb::arg("counter"), nb::arg("value"), nb::arg("stream") = 0);
  m.def("cuda_wait",
        [](const std::vector<std::pair<uint64_t, uint64_t>>& w, uint64_t stream) {
          auto v = specs_of(w);
          wait_geq(strm(stream), v.data(), v.size());
        },
        nb::arg("waits"), nb::arg("stream") = 0, "WAIT: stream waits until each *counter >= value.");
  m.def("cuda_multicast_allowed", &multicast_allowed, nb::arg("device") = 0,
        "Evaluate the multicast safety gate (never creates a multicast object).");
  // Minimal memory helpers (sanitizer cases and tests that must not load a framework).
  m.def("cuda_malloc", [](size_t bytes) {
    void* p = nullptr;
    TIDE_CHECK_CUDA(cudaMalloc(&p, bytes), "cuda_malloc(", bytes, ")");
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
  });
  m.def("cuda_free", [](uint64_t p) { TIDE_CHECK_CUDA(cudaFree(ptr<void>(p))); });
  m.def("cuda_h2d", [](uint64_t dst, nb::bytes data) {
    TIDE_CHECK_CUDA(cudaMemcpy(ptr<void>(dst), data.c_str(), data.size(), cudaMemcpyHostToDevice));
  });
  m.def("cuda_d2h", [](uint64_t src, size_t n) {
    std::string out(n, '\0');
    TIDE_CHECK_CUDA(cudaMemcpy(out.data(), ptr<const void>(src), n, cudaMemcpyDeviceToHost));
    return nb::bytes(out.data(), out.size());
  });
  m.def("cuda_memset", [](uint64_t dst, int value, size_t bytes, uint64_t stream) {
    TIDE_CHECK_CUDA(cudaMemsetAsync(ptr<void>(dst), value, bytes, strm(stream)), "cuda_memset");
  }, nb::arg("dst"), nb::arg("value"), nb::arg("bytes"), nb::arg("stream") = 0);
  m.def("cuda_synchronize", []() { TIDE_CHECK_CUDA(cudaDeviceSynchronize(), "cuda_synchronize"); },
        nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_capabilities", [](int device) {
    const Capabilities c = probe_capabilities(device);
    nb::dict d;
    d["device"] = c.device; d["name"] = c.name; d["cc"] = nb::make_tuple(c.cc_major, c.cc_minor);
    d["sm_count"] = c.sm_count; d["async_engines"] = c.async_engines; d["smem_optin"] = c.smem_optin;
    d["l2_bytes"] = c.l2_bytes; d["memops64"] = c.memops64;
    d["multicast_supported"] = c.multicast_supported; d["multicast_allowed"] = c.multicast_allowed;
    return d;
  }, nb::arg("device") = 0, "Capability probe (ranks compare these; multicast fields only report).");
  m.def("cuda_is_capturing", [](uint64_t stream) { return stream_is_capturing(strm(stream)); });

  nb::class_<Watchdog>(m, "CudaWatchdog")
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
void bind_cuda_exec(nb::module_& m);  // bind_cuda_exec.cc
void bind_nccl(nb::module_& m);       // bind_nccl.cc
#endif

void bind_cuda(nb::module_& m) {
  m.def("cuda_device_count", []() {
#ifdef TIDE_WITH_CUDA
    return tide::cuda::device_count();
#else
    return 0;
#endif
  }, "Number of usable CUDA devices (0 without a CUDA build, driver or device).");
  m.def("cuda_available", []() {
#ifdef TIDE_WITH_CUDA
    return tide::cuda::device_count() > 0;
#else
    return false;
#endif
  }, "True when this build has the CUDA executor and a CUDA device is usable.");
#ifdef TIDE_WITH_CUDA
  bind_cuda_ops(m);
  bind_nccl(m);
  bind_cuda_exec(m);
#else
  // The CUDA names exist without CUDA too, so callers (tide_torch) get a clear error, not an
  // AttributeError.
  m.def("nccl_header_version", []() { return 0; }, "0: this build has no NCCL fabric.");
  for (const char* name : {"CudaIpcFabric", "CudaRankExecutor", "cuda_capabilities", "NcclFabric", "nccl_unique_id",
                           "nccl_version", "nccl_library_path"}) {
    const std::string msg = std::string(name) +
                            ": this build of tide._core has no CUDA executor (built with TIDE_CUDA=off or "
                            "without nvcc); rebuild with TIDE_CUDA=on on a machine with the CUDA toolkit";
    m.def(name, [msg](nb::args, nb::kwargs) -> nb::object { throw tide::PlanError(msg); });
  }
#endif
}
