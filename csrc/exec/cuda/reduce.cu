// REDUCE: the executor's generic SUM / LAND over a program's terms (contract in kernels.h).
//
// [Note: why a second kernel]
// kernels.cu's SUM is the Level-1 fast path with a fixed operand shape (dense staged slices +
// a piecewise own term). Programs may cut terms differently (valid extents, spares, several
// pieces per term), so the executor runs this run-table kernel, which takes any term shape with
// the same per-CTA work split and 16-byte loads. Both start from the association in kernels.h.
#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "exec/cuda/device.cuh"
#include "exec/cuda/kernels.h"
#include "tide/errors.h"

namespace tide::cuda {
namespace {

constexpr int kReduceThreads = 256;  // with up to 255 registers (launch bounds: 1 CTA/SM)
constexpr int kV = 8;  // elements per vector step of the generic body (and the CTA split unit)

// [Note: REDUCE bodies and bytes in flight]
// The first H200 run measured this kernel at 8 GB/s per CTA against SUM's 99 on the same data:
// its one body tested, per term, `src[i] != nullptr` and the runtime dtype bit, and nvcc put each
// term's 16-byte load in its own branch region together with the unpack that uses it, so the T
// loads of an iteration waited for each other (T x HBM latency per iteration). Now:
//   - the dtype pattern is a template parameter (all bf16: Level-1 SUM; all fp16: the same of
//     fp16 gradients; all fp32: LAND over inbox blocks; mixed), picked on the host from
//     fp32_terms and fp16_terms;
//   - a run whose terms are all present (uniform per run) and whose pattern is not mixed takes
//     the dense body: every term's 16-byte words for kDenseUnroll words per thread are loaded,
//     unconditionally, before the first add (as sum_kernel does);
//   - any other run takes the generic body: loads are branch-free (an absent term reads the
//     dst words instead and is then skipped), issued a group of terms at a time before the
//     group's adds, so at most ceil(T / group) latencies per iteration.
// The association is unchanged (kernels.h): the first present term initialises, later present
// terms are added in order, then LAND's alpha/accumulate.
enum Pattern : int { kAllBf16 = 0, kAllF32 = 1, kMixed = 2, kAllF16 = 3 };
// All terms 16-bit items of one dtype: 8 elements per 16-byte word.
constexpr bool half_only(int P) { return P == kAllBf16 || P == kAllF16; }

// 16-byte words per term per thread per dense iteration: ~128 registers of loaded words at most,
// 1..16. At L = 8 all bf16 that is 256 threads x 4 x 8 x 16 B = 128 KiB in flight per CTA. A cap
// of 4 words was measured too shallow: a one-term fp32 LAND then kept 16 KiB in flight per CTA and ran at half
// kernels.cu's LAND (37 GB/s per CTA at 4 CTAs, 1.58x its floor at a full grid); few terms now
// unroll deeper (one fp32 term with its accumulate operand: 10 words).
__host__ __device__ constexpr int dense_unroll(int words) {
  return 128 / (4 * words) < 1 ? 1 : (128 / (4 * words) > 16 ? 16 : 128 / (4 * words));
}

__device__ __forceinline__ void unpack(float (&x)[kV], const uint4& lo, const uint4& hi, bool fp32, bool fp16) {
  if (fp32) {
    x[0] = __uint_as_float(lo.x); x[1] = __uint_as_float(lo.y);
    x[2] = __uint_as_float(lo.z); x[3] = __uint_as_float(lo.w);
    x[4] = __uint_as_float(hi.x); x[5] = __uint_as_float(hi.y);
    x[6] = __uint_as_float(hi.z); x[7] = __uint_as_float(hi.w);
  } else {
    const uint32_t w[4] = {lo.x, lo.y, lo.z, lo.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = fp16 ? device::half_lo<true>(w[i]) : device::bf16_lo(w[i]);
      x[2 * i + 1] = fp16 ? device::half_hi<true>(w[i]) : device::bf16_hi(w[i]);
    }
  }
}

__device__ __forceinline__ float load1(const char* p, int64_t k, bool fp32, bool fp16) {
  if (fp32) return reinterpret_cast<const float*>(p)[k];
  const uint16_t h = reinterpret_cast<const uint16_t*>(p)[k];
  return fp16 ? tide::fp16_to_fp32(h) : tide::bf16_to_fp32(h);
}

__device__ __forceinline__ float finish(const ReduceArgs& a, float t, float old) {
  if (!a.land) return t;
  const float v = __fmul_rn(a.alpha, t);
  return a.accumulate ? __fadd_rn(old, v) : v;
}

template <int T, int P>
__device__ __forceinline__ bool term_fp32(const ReduceArgs& a, int i) {
  return P == kAllF32 ? true : (half_only(P) ? false : ((a.fp32_terms >> i) & 1) != 0);
}
template <int T, int P>
__device__ __forceinline__ bool term_fp16(const ReduceArgs& a, int i) {
  return P == kAllF16 ? true : (P != kMixed ? false : ((a.fp16_terms >> i) & 1) != 0);
}

// Words per term per thread of one dense iteration (dense_body): all fp32 hoists the accumulate
// operand, so its budget counts two extra words (old value, addresses); 11-12 terms take one word
// (ptxas -v: no spills).
template <int T, int P>
__host__ __device__ constexpr int dense_words() {
  return P == kAllF32 ? (T > 10 ? 1 : dense_unroll(T + 2)) : dense_unroll(T);
}

// Dense body: every term present, one dtype (P != kMixed). p[i] = term i at element bv (16-byte
// aligned); nw 16-byte words per term, E elements per word.
template <int T, int P>
__device__ __forceinline__ void dense_body(const ReduceArgs& a, const char* const (&p)[T], int64_t bv,
                                           int64_t nw) {
  constexpr int E = P == kAllF32 ? 4 : 8;
  // LAND over fp32 inbox terms loads the accumulate operand with the terms; an all-bf16 LAND
  // with accumulate (no program emits one) loads it after them. All fp32: the budget counts two
  // extra words (old value, addresses), and 11-12 terms take one word (ptxas -v: no spills).
  constexpr bool kHoistOld = P == kAllF32;
  constexpr int U = dense_words<T, P>();
  const bool acc = a.land && a.accumulate;
  // The launch always has kReduceThreads threads: word u of an iteration sits at a constant
  // offset from the thread's running pointer, so only T pointers stay live.
  constexpr int64_t kStep = static_cast<int64_t>(U) * kReduceThreads;  // words per iteration
  const uint4* q[T];
#pragma unroll
  for (int i = 0; i < T; ++i) q[i] = reinterpret_cast<const uint4*>(p[i]) + threadIdx.x;
  float4* d = reinterpret_cast<float4*>(a.dst + bv) + threadIdx.x * (E / 4);
  for (int64_t w0 = threadIdx.x; w0 < nw; w0 += kStep) {
    uint4 x[T][U];
    float4 old[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (w0 + u * kReduceThreads < nw) {
#pragma unroll
        for (int i = 0; i < T; ++i) x[i][u] = __ldcs(q[i] + u * kReduceThreads);
        if (kHoistOld && acc) old[u] = d[u * kReduceThreads];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (w0 + u * kReduceThreads >= nw) continue;
      float t[E];
      float y[kV];
      unpack(y, x[0][u], x[0][u], P == kAllF32, P == kAllF16);
#pragma unroll
      for (int j = 0; j < E; ++j) t[j] = y[j];
#pragma unroll
      for (int i = 1; i < T; ++i) {
        unpack(y, x[i][u], x[i][u], P == kAllF32, P == kAllF16);
#pragma unroll
        for (int j = 0; j < E; ++j) t[j] = __fadd_rn(t[j], y[j]);
      }
#pragma unroll
      for (int h = 0; h < E / 4; ++h) {
        float4* dh = d + u * kReduceThreads * (E / 4) + h;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        if (acc) o = kHoistOld ? old[u] : *dh;
        *dh = make_float4(finish(a, t[4 * h + 0], o.x), finish(a, t[4 * h + 1], o.y),
                          finish(a, t[4 * h + 2], o.z), finish(a, t[4 * h + 3], o.w));
      }
    }
#pragma unroll
    for (int i = 0; i < T; ++i) q[i] += kStep;
    d += kStep * (E / 4);
  }
}

// Generic body: any presence, any pattern; one 8-element vector per thread per iteration.
// p[i] = term i at element bv or nullptr (absent).
template <int T, int P>
__device__ __forceinline__ void generic_body(const ReduceArgs& a, const char* const (&p)[T], int64_t bv,
                                             int64_t nv) {
  constexpr int G = half_only(P) ? 8 : 4;  // terms whose loads are issued together
  const bool acc = a.land && a.accumulate;
  for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
    const int64_t k = bv + v * kV;
    const uint4* dv = reinterpret_cast<const uint4*>(a.dst + k);  // stand-in for absent terms
    // Selects, not branches, below: a branch per term would let nvcc schedule the next term's
    // loads after this term's adds (what made the old body slow). An element no term covers
    // keeps 0.0f.
    float t[kV];
#pragma unroll
    for (int e = 0; e < kV; ++e) t[e] = 0.0f;
    bool have = false;  // the first present term initialises (no 0.0f + x: keeps -0.0)
#pragma unroll
    for (int g = 0; g < T; g += G) {
      uint4 lo[G], hi[G];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int i = g + j;
        if (i >= T) break;
        const bool f32 = term_fp32<T, P>(a, i);
        const uint4* q = p[i] ? reinterpret_cast<const uint4*>(p[i] + v * kV * (f32 ? 4 : 2)) : dv;
        lo[j] = __ldcs(q);
        if (!half_only(P)) hi[j] = __ldcs(f32 || !p[i] ? q + 1 : q);
      }
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int i = g + j;
        if (i >= T) break;
        const bool present = p[i] != nullptr;
        float y[kV];
        if (P == kMixed) {  // every decoding, then a select
          float yb[kV], yh[kV];
          unpack(y, lo[j], hi[j], true, false);
          unpack(yb, lo[j], lo[j], false, false);
          unpack(yh, lo[j], lo[j], false, true);
          const bool f32 = term_fp32<T, P>(a, i), f16 = term_fp16<T, P>(a, i);
#pragma unroll
          for (int e = 0; e < kV; ++e) y[e] = f32 ? y[e] : (f16 ? yh[e] : yb[e]);
        } else {
          unpack(y, lo[j], half_only(P) ? lo[j] : hi[j], P == kAllF32, P == kAllF16);
        }
#pragma unroll
        for (int e = 0; e < kV; ++e) {
          const float sum = __fadd_rn(t[e], y[e]);
          t[e] = present ? (have ? sum : y[e]) : t[e];
        }
        have = have || present;
      }
    }
    float4* d = reinterpret_cast<float4*>(a.dst + k);
    float4 o0 = make_float4(0.f, 0.f, 0.f, 0.f), o1 = o0;
    if (acc) {
      o0 = d[0];
      o1 = d[1];
    }
    d[0] = make_float4(finish(a, t[0], o0.x), finish(a, t[1], o0.y), finish(a, t[2], o0.z), finish(a, t[3], o0.w));
    d[1] = make_float4(finish(a, t[4], o1.x), finish(a, t[5], o1.y), finish(a, t[6], o1.z), finish(a, t[7], o1.w));
  }
}

// REDUCE over elements [begin, end) of dst (one CTA piece: a tile or a range).
template <int T, int P>
__device__ __forceinline__ void reduce_piece(const ReduceArgs& a, int64_t begin, int64_t end) {
  int lo = 0, hi = a.n_runs - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a.runs[mid].dst_off + a.runs[mid].len <= begin) lo = mid + 1; else hi = mid;
  }
  for (int ri = lo; ri < a.n_runs; ++ri) {
    const ReduceRun& run = a.runs[ri];
    const int64_t r0 = run.dst_off;
    if (r0 >= end) break;
    const int64_t b = max(begin, r0), e = min(end, r0 + run.len);
    // Vector body from the first 8-aligned element bv; [b, bv) and the tail run scalar.
    const int64_t bv = min(e, (b + kV - 1) / kV * kV);
    const char* pv[T];  // term i at element bv (nullptr: absent)
    bool vec = (reinterpret_cast<uintptr_t>(a.dst) & 15) == 0;
    bool dense = P != kMixed;
#pragma unroll
    for (int i = 0; i < T; ++i) {
      const int s = run.slot[i];
      const int64_t size = term_fp32<T, P>(a, i) ? 4 : 2;
      pv[i] = s >= 0 ? static_cast<const char*>(a.base[s]) + run.off[i] + (bv - r0) * size : nullptr;
      if (pv[i]) vec = vec && (reinterpret_cast<uintptr_t>(pv[i]) & 15) == 0;
      dense = dense && pv[i] != nullptr;
    }
    int64_t b_tail = b;
    if (vec) {
      const int64_t nv = (e - bv) / kV;
      b_tail = bv + nv * kV;
      if (dense)
        dense_body<T, P>(a, pv, bv, nv * kV / (P == kAllF32 ? 4 : 8));
      else
        generic_body<T, P>(a, pv, bv, nv);
    }
    const int64_t head_end = vec ? bv : b;  // scalar head [b, bv) when the body was vectorised
    for (int64_t k0 = threadIdx.x; k0 < (head_end - b) + (e - b_tail); k0 += blockDim.x) {
      const int64_t k = k0 < head_end - b ? b + k0 : b_tail + (k0 - (head_end - b));
      float t = 0.0f;
      bool have = false;
#pragma unroll
      for (int i = 0; i < T; ++i)
        if (pv[i]) {
          const float x = load1(pv[i], k - bv, term_fp32<T, P>(a, i), term_fp16<T, P>(a, i));
          t = have ? __fadd_rn(t, x) : x;
          have = true;
        }
      a.dst[k] = finish(a, t, a.land && a.accumulate ? a.dst[k] : 0.0f);
    }
  }
}

// Elements per CTA tile ([Note: CTA work split]): one dense iteration (the generic body of a
// mixed pattern: four of its iterations).
template <int T, int P>
constexpr int64_t reduce_tile() {
  return P == kMixed ? 4 * kReduceThreads * kV
                     : static_cast<int64_t>(dense_words<T, P>()) * kReduceThreads * (P == kAllF32 ? 4 : 8);
}

template <int T, int P>
__global__ void __launch_bounds__(kReduceThreads, 1) reduce_kernel(const __grid_constant__ ReduceArgs a, int split) {
  device::for_each_piece(a.n, kV, reduce_tile<T, P>(), split == kSplitRanges,
                         [&](int64_t b, int64_t e) { reduce_piece<T, P>(a, b, e); });
}

template <int T, int P>
void launch_tp(const ReduceArgs& a, int ctas, const LaunchKnobs& k, cudaStream_t s) {
  const int grid = grid_for(reinterpret_cast<const void*>(reduce_kernel<T, P>), kReduceThreads, ctas, a.n,
                            reduce_tile<T, P>(), k);
  reduce_kernel<T, P><<<grid, kReduceThreads, 0, s>>>(a, split_for(grid, k));
}

template <int T>
void launch_t(const ReduceArgs& a, int ctas, const LaunchKnobs& k, cudaStream_t s) {
  const uint32_t all = (1u << T) - 1u, f32 = a.fp32_terms & all, f16 = a.fp16_terms & all;
  TIDE_CHECK((f32 & f16) == 0, "REDUCE: a term both fp32 and fp16 (", f32, ", ", f16, ")");
  if (f32 == 0 && f16 == 0)
    launch_tp<T, kAllBf16>(a, ctas, k, s);
  else if (f16 == all)
    launch_tp<T, kAllF16>(a, ctas, k, s);
  else if (f32 == all)
    launch_tp<T, kAllF32>(a, ctas, k, s);
  else
    launch_tp<T, kMixed>(a, ctas, k, s);
}

template <int... I>
void reduce_attrs(std::integer_sequence<int, I...>, std::vector<KernelAttrs>* out) {
  auto one = [&](auto kernel, int t, const char* pattern) {
    cudaFuncAttributes fa{};
    TIDE_CHECK_CUDA(cudaFuncGetAttributes(&fa, kernel), "cudaFuncGetAttributes(reduce_kernel)");
    out->push_back({"reduce_kernel<" + std::to_string(t) + pattern + ">", fa.numRegs,
                    static_cast<int>(fa.localSizeBytes), static_cast<int>(fa.sharedSizeBytes), fa.maxThreadsPerBlock});
  };
  // "<T>": all bf16 (Level-1 SUM), "<T,fp16>": all fp16, "<T,fp32>": all fp32 (LAND), "<T,mixed>".
  (one(reduce_kernel<I + 1, kAllBf16>, I + 1, ""), ...);
  (one(reduce_kernel<I + 1, kAllF16>, I + 1, ",fp16"), ...);
  (one(reduce_kernel<I + 1, kAllF32>, I + 1, ",fp32"), ...);
  (one(reduce_kernel<I + 1, kMixed>, I + 1, ",mixed"), ...);
}

}  // namespace

template <int... I>
int reduce_occupancy(std::integer_sequence<int, I...>, int n_terms, bool fp32) {
  int k = 0;
  auto one = [&](auto kernel, int t) {
    if (t == n_terms) k = resident_per_sm(reinterpret_cast<const void*>(kernel), kReduceThreads);
  };
  if (fp32)
    (one(reduce_kernel<I + 1, kAllF32>, I + 1), ...);
  else
    (one(reduce_kernel<I + 1, kAllBf16>, I + 1), ...);
  return k;
}

int reduce_resident_ctas_per_sm(int n_terms, bool fp32) {
  TIDE_PLAN_CHECK(n_terms >= 1 && n_terms <= kMaxTerms, "resident_ctas_per_sm: REDUCE terms ", n_terms,
                  " outside [1, ", kMaxTerms, "]");
  return reduce_occupancy(std::make_integer_sequence<int, kMaxTerms>{}, n_terms, fp32);
}

void append_reduce_kernel_attrs(std::vector<KernelAttrs>* out) {
  reduce_attrs(std::make_integer_sequence<int, kMaxTerms>{}, out);
}

void launch_reduce(const ReduceArgs& a, int ctas, const LaunchKnobs& knobs, cudaStream_t stream) {
  TIDE_CHECK(a.n_terms >= 1 && a.n_terms <= kMaxTerms, "REDUCE n_terms=", a.n_terms);
  TIDE_CHECK(a.n == 0 || (a.dst && a.runs && a.n_runs > 0), "REDUCE needs dst and runs");
  if (a.n == 0) return;
  int64_t need = (a.n / kV + kReduceThreads) / kReduceThreads;
  const int c = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ctas > 0 ? ctas : 1, need)));
  switch (a.n_terms) {
    case 1: launch_t<1>(a, c, knobs, stream); break;
    case 2: launch_t<2>(a, c, knobs, stream); break;
    case 3: launch_t<3>(a, c, knobs, stream); break;
    case 4: launch_t<4>(a, c, knobs, stream); break;
    case 5: launch_t<5>(a, c, knobs, stream); break;
    case 6: launch_t<6>(a, c, knobs, stream); break;
    case 7: launch_t<7>(a, c, knobs, stream); break;
    case 8: launch_t<8>(a, c, knobs, stream); break;
    case 9: launch_t<9>(a, c, knobs, stream); break;
    case 10: launch_t<10>(a, c, knobs, stream); break;
    case 11: launch_t<11>(a, c, knobs, stream); break;
    default: launch_t<12>(a, c, knobs, stream); break;
  }
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching REDUCE");
}

}  // namespace tide::cuda
