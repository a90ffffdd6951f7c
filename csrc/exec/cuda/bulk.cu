// The `bulk` SUM/REDUCE variant (TIDE_SUM_KERNEL=bulk; contract and association in kernels.h).
//
// [Note: bulk pipeline]
// Why: a CTA's rate is bytes in flight / latency (Little's law). At ~0.6-0.8 us loaded HBM
// latency, 100 GB/s per CTA needs 64-80 KB in flight; register-staged loads (256-512 threads x
// T terms x 16 B) top out near that and measured 98/95/86 GB/s per CTA at 4/8/16 CTAs and 78 %
// of the copy ceiling at a full grid (BENCHMARKS.md Run 2). Bulk copies land in shared memory
// without registers, so the in-flight depth is set by the ring, not the register file.
//
// Shape: one producer warp + kConsumerWarps consumer warps per CTA, a ring of `stages` stages in
// dynamic shared memory. Stage s holds, for every term i of the launch, `chunk` elements at byte
// offset off[i] (bf16 or fp32; absent terms leave their slot unused). Per stage two mbarriers:
//   full[s]  : 1 arrival (the producer's arrive.expect_tx) + the stage's transaction bytes
//   empty[s] : kConsumerWarps arrivals (lane 0 of each consumer warp, after __syncwarp)
// Chunk number `it` (a per-CTA running count over all pieces) uses stage it % stages in its
// use u = it / stages. The producer waits empty[s] for parity (u & 1) ^ 1 (use u - 1 released;
// on a fresh barrier parity 1 passes at once), arms full[s] with the chunk's bytes, then its
// lanes issue one cp.async.bulk per present term. Consumers wait full[s] for parity u & 1, add
// the terms from shared memory in the fixed order, store fp32 with 16-byte stores, and release
// empty[s]. Parities cannot alias: full[s] phase u + 1 needs every consumer warp to release
// use u, and empty[s] phase u needs full[s] phase u, which only the waiting producer arms.
// Producer and consumers walk the same pieces with the same arithmetic, so they agree on `it`.
//
// Pieces (SUM segments / REDUCE runs clipped to the CTA's range) whose terms are all 16-byte
// aligned at the first 8-aligned element go through the ring; their unaligned head and tail and
// every other piece take the scalar path (consumers, straight from global memory), as the
// vector kernels do. The CTA budget and the work split are the vector kernels' (contiguous
// 8-element-aligned ranges, no persistence, one CTA per SM: the ring takes ~192 KiB).
//
// Prediction (before the first H200 run): with 6 stages x 32 KiB (L = 8: 7 staged + own bf16,
// chunk 2048 elements, one 4 KiB copy per term) up to ~160 KiB is in flight per CTA, about twice
// Little's bound, so a CTA is no longer latency bound. What bounds it next is one SM's share of
// the L2 fabric (~64 B/clk, ~120 GB/s of reads; 100 GB/s logical needs 80 GB/s of reads) and the
// consumers (~160 instructions per warp per 40 KB chunk, ~150 ns, well under the ~330 ns a chunk
// takes at 120 GB/s). Predicted: 105-130 GB/s per CTA at 1-16 CTAs (vec: 98/95/86 at 1/4/16,
// Run 2), and at a full grid HBM-bound at 85-90 % of the copy ceiling (bulk reads, plain
// 16-byte stores; vec: 78 %). REDUCE's `vec` kernel (256 threads, one 16-byte load per term per
// thread: 32 KiB in flight at L = 8) should sit near 40-50 GB/s per CTA; its `bulk` variant is
// the same ring as SUM's and should match SUM bulk within a few percent.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "exec/cuda/device.cuh"
#include "exec/cuda/kernels.h"
#include "tide/errors.h"

namespace tide::cuda {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumerThreads = 32 * kConsumerWarps;
constexpr int kBulkThreads = kConsumerThreads + 32;  // + the producer warp
constexpr int kMaxStages = 16;
constexpr int kStageBytes = 32 << 10;  // target bytes per stage (all terms); TIDE_BULK_STAGE_KIB
constexpr int kRingBytes = 192 << 10;  // shared memory for the ring
constexpr int kV = 8;                  // elements per consumer vector

// Per-launch ring geometry (identical for every CTA; a kernel parameter).
struct Ring {
  int stages = 0;
  int chunk = 0;              // elements per stage, a multiple of kV
  int stage_bytes = 0;
  int off[kMaxTerms] = {};    // byte offset of term i inside a stage
};

struct Finish {
  int land = 0;
  int accumulate = 0;
  float alpha = 1.0f;
};

__device__ __forceinline__ float finish(const Finish& f, float t, const float* old) {
  if (!f.land) return t;
  const float v = __fmul_rn(f.alpha, t);
  return f.accumulate ? __fadd_rn(*old, v) : v;
}

// SUM (SumArgs): T = NS + 1 terms, staged slices 0..NS-1 then the own gradient; all bf16.
template <int NS>
struct SumTable {
  static constexpr int T = NS + 1;
  const SumArgs& a;
  __device__ int count() const { return a.n_segs; }
  __device__ int64_t start(int i) const { return a.segs[i].dst_off; }
  __device__ int64_t len(int i) const { return a.segs[i].len; }
  __device__ bool fp32(int) const { return false; }
  // src[i]: term i's element at dst index start(p), or nullptr when the term is absent.
  __device__ void sources(int p, const char* (&src)[T]) const {
    const SumSegment& sg = a.segs[p];
#pragma unroll
    for (int j = 0; j < NS; ++j) src[j] = reinterpret_cast<const char*>(a.staged[j] + sg.dst_off);
    src[NS] = sg.param >= 0 ? reinterpret_cast<const char*>(a.grad[sg.param] + sg.src_off) : nullptr;
  }
};

// REDUCE (ReduceArgs): T program terms, bf16 or fp32 each (fp32_terms).
template <int TT>
struct RunTable {
  static constexpr int T = TT;
  const ReduceArgs& a;
  __device__ int count() const { return a.n_runs; }
  __device__ int64_t start(int i) const { return a.runs[i].dst_off; }
  __device__ int64_t len(int i) const { return a.runs[i].len; }
  __device__ bool fp32(int i) const { return (a.fp32_terms >> i) & 1; }
  __device__ void sources(int p, const char* (&src)[T]) const {
    const ReduceRun& r = a.runs[p];
#pragma unroll
    for (int i = 0; i < T; ++i) {
      const int s = r.slot[i];
      src[i] = s >= 0 ? static_cast<const char*>(a.base[s]) + r.off[i] : nullptr;
    }
  }
};

// One element k through the scalar path (global loads, same association).
template <class Tab>
__device__ __forceinline__ void scalar_one(const Tab& tb, const char* const (&src)[Tab::T], int64_t r0,
                                           int64_t k, float* dst, const Finish& f) {
  float t = 0.0f;
  bool have = false;  // the first present term initialises (no 0.0f + x: keeps -0.0)
#pragma unroll
  for (int i = 0; i < Tab::T; ++i)
    if (src[i]) {
      const float x = tb.fp32(i) ? reinterpret_cast<const float*>(src[i])[k - r0]
                                 : __uint_as_float(static_cast<uint32_t>(
                                       reinterpret_cast<const uint16_t*>(src[i])[k - r0]) << 16);
      t = have ? __fadd_rn(t, x) : x;
      have = true;
    }
  dst[k] = finish(f, t, dst + k);
}

template <class Tab>
__device__ void bulk_body(const Tab& tb, int64_t n, float* dst, const Ring& g, const Finish& f) {
  constexpr int T = Tab::T;
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  __shared__ __align__(8) uint64_t empty[kMaxStages];

  int64_t per = (n + gridDim.x - 1) / gridDim.x;
  per = (per + kV - 1) / kV * kV;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * per;
  const int64_t end = min(n, begin + per);
  if (begin >= end) return;  // uniform over the CTA, before any barrier

  if (threadIdx.x == 0) {
    for (int s = 0; s < g.stages; ++s) {
      device::mbar_init(&full[s], 1);
      device::mbar_init(&empty[s], kConsumerWarps);
    }
    device::mbar_init_fence();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles never meet again except via mbarriers

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const bool producer = warp == kConsumerWarps;
  const int ctid = static_cast<int>(threadIdx.x);  // consumer thread id (< kConsumerThreads)
  const bool dst_ok = (reinterpret_cast<uintptr_t>(dst) & 15) == 0;

  int lo = 0, hi = tb.count() - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (tb.start(mid) + tb.len(mid) <= begin) lo = mid + 1; else hi = mid;
  }
  uint32_t it = 0;  // chunks so far (ring position), the same count in every warp
  for (int pi = lo; pi < tb.count(); ++pi) {
    const int64_t r0 = tb.start(pi);
    if (r0 >= end) break;
    const int64_t b = max(begin, r0), e = min(end, r0 + tb.len(pi));
    const char* src[T];
    tb.sources(pi, src);
    // The ring takes [bv, ev): from the first 8-aligned element, whole vectors, when every
    // present term (and dst) is 16-byte aligned there and at least one term is present.
    const int64_t bv = min(e, (b + kV - 1) / kV * kV);
    bool vec = dst_ok, any = false;
    uint32_t bytes_per_elem = 0;  // of the present terms
#pragma unroll
    for (int i = 0; i < T; ++i)
      if (src[i]) {
        const int64_t size = tb.fp32(i) ? 4 : 2;
        any = true;
        bytes_per_elem += static_cast<uint32_t>(size);
        vec = vec && ((reinterpret_cast<uintptr_t>(src[i]) + (bv - r0) * size) & 15) == 0;
      }
    const int64_t nv = vec && any ? (e - bv) / kV : 0;
    const int64_t ev = bv + nv * kV;
    const int64_t n_chunks = (nv * kV + g.chunk - 1) / g.chunk;

    if (producer) {
      for (int64_t c = 0; c < n_chunks; ++c, ++it) {
        const int s = static_cast<int>(it % static_cast<uint32_t>(g.stages));
        const uint32_t use = it / static_cast<uint32_t>(g.stages);
        const int64_t k0 = bv + c * g.chunk;
        const int64_t len = min(static_cast<int64_t>(g.chunk), ev - k0);
        // Every lane waits, so each lane that issues a copy has itself observed the release of
        // the stage (consumers' reads ordered before the copy's writes).
        device::mbar_wait(&empty[s], (use & 1u) ^ 1u);
        if (lane == 0) device::mbar_arrive_expect_tx(&full[s], static_cast<uint32_t>(len) * bytes_per_elem);
        __syncwarp();
        unsigned char* stage = ring + static_cast<size_t>(s) * g.stage_bytes;
#pragma unroll
        for (int i = 0; i < T; ++i)
          if (lane == i && src[i]) {
            const int64_t size = tb.fp32(i) ? 4 : 2;
            device::bulk_load(stage + g.off[i], src[i] + (k0 - r0) * size, static_cast<uint32_t>(len * size),
                              &full[s]);
          }
      }
      continue;
    }

    // Consumers: the scalar head [b, bv) and tail [ev, e) (or the whole piece without a ring
    // body) first, while the producer's first copies are in flight.
    const int64_t head = nv > 0 ? bv - b : 0;
    const int64_t tail0 = nv > 0 ? ev : b;
    for (int64_t q = ctid; q < head + (e - tail0); q += kConsumerThreads)
      scalar_one(tb, src, r0, q < head ? b + q : tail0 + (q - head), dst, f);

    for (int64_t c = 0; c < n_chunks; ++c, ++it) {
      const int s = static_cast<int>(it % static_cast<uint32_t>(g.stages));
      const uint32_t use = it / static_cast<uint32_t>(g.stages);
      const int64_t k0 = bv + c * g.chunk;
      const int nvec = static_cast<int>(min(static_cast<int64_t>(g.chunk), ev - k0) / kV);
      const unsigned char* stage = ring + static_cast<size_t>(s) * g.stage_bytes;
      device::mbar_wait(&full[s], use & 1u);
      for (int v = ctid; v < nvec; v += kConsumerThreads) {
        float t[kV];
        bool have = false;
#pragma unroll
        for (int i = 0; i < T; ++i) {
          if (!src[i]) continue;
          float x[kV];
          if (tb.fp32(i)) {
            const float4* p = reinterpret_cast<const float4*>(stage + g.off[i]) + 2 * v;
            const float4 u0 = p[0], u1 = p[1];
            x[0] = u0.x; x[1] = u0.y; x[2] = u0.z; x[3] = u0.w;
            x[4] = u1.x; x[5] = u1.y; x[6] = u1.z; x[7] = u1.w;
          } else {
            const uint4 w = reinterpret_cast<const uint4*>(stage + g.off[i])[v];
            const uint32_t wd[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              x[2 * j] = device::bf16_lo(wd[j]);
              x[2 * j + 1] = device::bf16_hi(wd[j]);
            }
          }
#pragma unroll
          for (int j = 0; j < kV; ++j) t[j] = have ? __fadd_rn(t[j], x[j]) : x[j];
          have = true;
        }
        float4* d = reinterpret_cast<float4*>(dst + k0 + static_cast<int64_t>(v) * kV);
        float old[kV];
        if (f.land && f.accumulate) {
          const float4 o0 = d[0], o1 = d[1];
          old[0] = o0.x; old[1] = o0.y; old[2] = o0.z; old[3] = o0.w;
          old[4] = o1.x; old[5] = o1.y; old[6] = o1.z; old[7] = o1.w;
        }
        float out[kV];
#pragma unroll
        for (int j = 0; j < kV; ++j) out[j] = finish(f, t[j], old + j);
        d[0] = make_float4(out[0], out[1], out[2], out[3]);
        d[1] = make_float4(out[4], out[5], out[6], out[7]);
      }
      // [Note: releasing a stage] The producer's next bulk copy into this stage is an async-proxy
      // write after these generic-proxy reads (a cross-proxy WAR). Each lane fences its reads
      // against the async proxy, the warp converges, and lane 0's release arrival (cumulative
      // over the warp's reads via __syncwarp) hands the stage back. The first H200 racecheck run
      // (no fence) reported hazards between these reads and bulk_load's writes; see
      // tools/gpu/kperf.sh for the run that tells a real WAR from a racecheck limitation.
      device::fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) device::mbar_arrive(&empty[s]);
    }
  }
}

template <int NS>
__global__ void __launch_bounds__(kBulkThreads, 1) sum_bulk_kernel(const __grid_constant__ SumArgs a, const Ring g) {
  bulk_body(SumTable<NS>{a}, a.n, a.dst, g, Finish{});
}

template <int T>
__global__ void __launch_bounds__(kBulkThreads, 1) reduce_bulk_kernel(const __grid_constant__ ReduceArgs a,
                                                                      const Ring g) {
  bulk_body(RunTable<T>{a}, a.n, a.dst, g, Finish{a.land, a.accumulate, a.alpha});
}

// Target bytes per stage. TIDE_BULK_STAGE_KIB (8..96; read at every launch) exists for the sweep's
// ring-geometry rows only (tide/bench/sum_sweep.py --bulk-ring): at a fixed ring, a rate
// that follows the stage size points at a per-chunk cost, one that follows the bytes in flight
// (stages x stage size) at copy latency.
int stage_bytes() {
  const char* v = std::getenv("TIDE_BULK_STAGE_KIB");
  if (v == nullptr || *v == '\0') return kStageBytes;
  char* end = nullptr;
  const long kib = std::strtol(v, &end, 10);
  TIDE_PLAN_CHECK(end != v && *end == '\0' && kib >= 8 && kib <= 96, "TIDE_BULK_STAGE_KIB=", v,
                  ": expected 8..96 (KiB per ring stage)");
  return static_cast<int>(kib) << 10;
}

// TIDE_BULK_STAGES (2..16, the sweep's ring rows only): at most this many stages. Equal rates
// at 2 and 6 stages of the same size would mean the stages do not overlap.
int stages_cap() {
  const char* v = std::getenv("TIDE_BULK_STAGES");
  if (v == nullptr || *v == '\0') return kMaxStages;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  TIDE_PLAN_CHECK(end != v && *end == '\0' && n >= 2 && n <= kMaxStages, "TIDE_BULK_STAGES=", v,
                  ": expected 2..", kMaxStages);
  return static_cast<int>(n);
}

// Ring geometry for terms of `sizes` bytes per element: ~stage_bytes() per stage, as many stages
// as kRingBytes holds (2..kMaxStages).
Ring make_ring(const int* sizes, int n_terms) {
  Ring g;
  int bpe = 0;
  for (int i = 0; i < n_terms; ++i) {
    g.off[i] = bpe;  // scaled by chunk below
    bpe += sizes[i];
  }
  g.chunk = std::max(kV, (stage_bytes() / bpe) / kV * kV);
  for (int i = 0; i < n_terms; ++i) g.off[i] *= g.chunk;  // multiples of 16 bytes: chunk % 8 == 0
  g.stage_bytes = g.chunk * bpe;
  g.stages = std::min(stages_cap(), kRingBytes / g.stage_bytes);
  return g;
}

int current_device() {
  int dev = 0;
  TIDE_CHECK_CUDA(cudaGetDevice(&dev), "cudaGetDevice");
  return dev;
}

// The ring's dynamic shared memory (> 48 KiB) needs a per-kernel opt-in. bulk_supported() does
// it for every instantiation at once, the first time it sees a device, so the first bulk launch
// inside a stream capture finds it done (the variant fixture of the tests, the sweep, and
// sum_kernel_effective() at every launch all ask bulk_supported() first).
template <class K>
void opt_in(K kernel) {
  TIDE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes),
                  "raising the bulk SUM kernel's shared memory to ", kRingBytes, " bytes");
}
template <int... I>
void opt_in_sum(std::integer_sequence<int, I...>) {
  (opt_in(sum_bulk_kernel<I>), ...);
}
template <int... I>
void opt_in_reduce(std::integer_sequence<int, I...>) {
  (opt_in(reduce_bulk_kernel<I + 1>), ...);
}

int clamp(int ctas, int64_t n) {
  const int64_t need = (n / kV + kConsumerThreads) / kConsumerThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ctas > 0 ? ctas : 1, need)));
}

template <int NS>
void sum_ns(const SumArgs& a, int ctas, cudaStream_t s) {
  int sizes[NS + 1];
  for (int i = 0; i <= NS; ++i) sizes[i] = 2;
  const Ring g = make_ring(sizes, NS + 1);
  sum_bulk_kernel<NS><<<clamp(ctas, a.n), kBulkThreads, g.stages * g.stage_bytes, s>>>(a, g);
}

template <int T>
void reduce_t(const ReduceArgs& a, int ctas, cudaStream_t s) {
  int sizes[T];
  for (int i = 0; i < T; ++i) sizes[i] = (a.fp32_terms >> i) & 1 ? 4 : 2;
  const Ring g = make_ring(sizes, T);
  reduce_bulk_kernel<T><<<clamp(ctas, a.n), kBulkThreads, g.stages * g.stage_bytes, s>>>(a, g);
}

template <class K>
void attrs_of(K kernel, const char* name, int t, std::vector<KernelAttrs>* out) {
  cudaFuncAttributes fa{};
  TIDE_CHECK_CUDA(cudaFuncGetAttributes(&fa, kernel), "cudaFuncGetAttributes(", name, ")");
  out->push_back({std::string(name) + "<" + std::to_string(t) + ">", fa.numRegs, static_cast<int>(fa.localSizeBytes),
                  static_cast<int>(fa.sharedSizeBytes), fa.maxThreadsPerBlock});
}

template <int... I>
void sum_attrs(std::integer_sequence<int, I...>, std::vector<KernelAttrs>* out) {
  (attrs_of(sum_bulk_kernel<I>, "sum_bulk_kernel", I, out), ...);
}
template <int... I>
void reduce_attrs(std::integer_sequence<int, I...>, std::vector<KernelAttrs>* out) {
  (attrs_of(reduce_bulk_kernel<I + 1>, "reduce_bulk_kernel", I + 1, out), ...);
}

}  // namespace

void append_bulk_kernel_attrs(std::vector<KernelAttrs>* out) {
  sum_attrs(std::make_integer_sequence<int, kMaxStaged + 1>{}, out);
  reduce_attrs(std::make_integer_sequence<int, kMaxTerms>{}, out);
}

bool bulk_supported() {
  static std::atomic<uint64_t> known{0}, ok{0};
  const int dev = current_device();
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (known.load(std::memory_order_acquire) & bit) return ok.load(std::memory_order_acquire) & bit;
  int major = 0, optin = 0;
  TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "compute capability");
  TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                  "shared memory per block");
  const bool yes = major >= 9 && optin >= kRingBytes + 2 * kMaxStages * 8;
  if (yes) {
    opt_in_sum(std::make_integer_sequence<int, kMaxStaged + 1>{});
    opt_in_reduce(std::make_integer_sequence<int, kMaxTerms>{});
    ok.fetch_or(bit, std::memory_order_acq_rel);
  }
  known.fetch_or(bit, std::memory_order_acq_rel);
  return yes;
}

void launch_sum_bulk(const SumArgs& a, int ctas, cudaStream_t stream) {
  switch (a.n_staged) {
    case 0: sum_ns<0>(a, ctas, stream); break;
    case 1: sum_ns<1>(a, ctas, stream); break;
    case 2: sum_ns<2>(a, ctas, stream); break;
    case 3: sum_ns<3>(a, ctas, stream); break;
    case 4: sum_ns<4>(a, ctas, stream); break;
    case 5: sum_ns<5>(a, ctas, stream); break;
    case 6: sum_ns<6>(a, ctas, stream); break;
    default: sum_ns<7>(a, ctas, stream); break;
  }
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching SUM (bulk)");
}

void launch_reduce_bulk(const ReduceArgs& a, int ctas, cudaStream_t stream) {
  switch (a.n_terms) {
    case 1: reduce_t<1>(a, ctas, stream); break;
    case 2: reduce_t<2>(a, ctas, stream); break;
    case 3: reduce_t<3>(a, ctas, stream); break;
    case 4: reduce_t<4>(a, ctas, stream); break;
    case 5: reduce_t<5>(a, ctas, stream); break;
    case 6: reduce_t<6>(a, ctas, stream); break;
    case 7: reduce_t<7>(a, ctas, stream); break;
    case 8: reduce_t<8>(a, ctas, stream); break;
    case 9: reduce_t<9>(a, ctas, stream); break;
    case 10: reduce_t<10>(a, ctas, stream); break;
    case 11: reduce_t<11>(a, ctas, stream); break;
    default: reduce_t<12>(a, ctas, stream); break;
  }
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching REDUCE (bulk)");
}

}  // namespace tide::cuda
