// REDUCE: the executor's generic SUM / LAND over a program's terms (contract in kernels.h).
//
// [Note: why a second kernel]
// kernels.cu's SUM is the Level-1 fast path with a fixed operand shape (dense staged slices +
// a piecewise own term). Programs may cut terms differently (valid extents, spares, several
// pieces per term), so the executor runs this run-table kernel, which takes any term shape with
// the same per-CTA work split and 16-byte loads. Both start from the association in kernels.h.
// TIDE_SUM_KERNEL picks this kernel (`vec`), it with the L2 prefetch (`vec_l2`) or the bulk
// pipeline of bulk.cu (`bulk`); kernels.h.
#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "exec/cuda/device.cuh"
#include "exec/cuda/kernels.h"
#include "tide/errors.h"

namespace tide::cuda {
namespace {

constexpr int kReduceThreads = 256;
constexpr int kV = 8;  // elements per vector step

__device__ __forceinline__ void load8(float (&x)[kV], const char* p, bool fp32) {
  if (fp32) {
    const float4 a = __ldcs(reinterpret_cast<const float4*>(p));
    const float4 b = __ldcs(reinterpret_cast<const float4*>(p) + 1);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  } else {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = device::bf16_lo(w[i]);
      x[2 * i + 1] = device::bf16_hi(w[i]);
    }
  }
}


__device__ __forceinline__ float load1(const char* p, int64_t k, bool fp32) {
  if (fp32) return reinterpret_cast<const float*>(p)[k];
  return __uint_as_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[k]) << 16);
}

__device__ __forceinline__ float finish(const ReduceArgs& a, float t, float old) {
  if (!a.land) return t;
  const float v = __fmul_rn(a.alpha, t);
  return a.accumulate ? __fadd_rn(old, v) : v;
}

template <int T>
__global__ void __launch_bounds__(kReduceThreads, 1) reduce_kernel(const __grid_constant__ ReduceArgs a, int l2) {
  int64_t per = (a.n + gridDim.x - 1) / gridDim.x;
  per = (per + kV - 1) / kV * kV;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * per;
  const int64_t end = min(a.n, begin + per);
  if (begin >= end) return;
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
    const char* src[T];
    bool vec = (reinterpret_cast<uintptr_t>(a.dst) & 15) == 0;
#pragma unroll
    for (int i = 0; i < T; ++i) {
      const int s = run.slot[i];
      src[i] = s >= 0 ? static_cast<const char*>(a.base[s]) + run.off[i] : nullptr;
      // Byte address of element bv of term i: src[i] + (bv - r0) * size.
      const int64_t size = (a.fp32_terms >> i) & 1 ? 4 : 2;
      if (src[i]) vec = vec && ((reinterpret_cast<uintptr_t>(src[i]) + (bv - r0) * size) & 15) == 0;
    }
    int64_t b_tail = b;
    if (vec) {
      const int64_t b = bv;  // the vector body starts aligned; [run b, bv) is done below
      const int64_t nv = (e - b) / kV;
      b_tail = b + nv * kV;
      const int64_t chunk = static_cast<int64_t>(blockDim.x) * kV;  // elements per iteration
      const int dist = device::prefetch_dist();
      auto prefetch = [&](int64_t it) {  // thread i < T prefetches term i of iteration `it`
        const int i = static_cast<int>(threadIdx.x);
        const int64_t first = it * chunk, span = min(chunk, nv * kV - first);
        if (i >= T || span <= 0) return;
#pragma unroll
        for (int t = 0; t < T; ++t)
          if (t == i && src[t]) {
            const int64_t size = (a.fp32_terms >> t) & 1 ? 4 : 2;
            device::l2_prefetch(src[t] + (b - r0 + first) * size, span * size);
          }
      };
      if (l2)
        for (int d = 0; d < dist; ++d) prefetch(d);
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
        if (l2) prefetch((v - threadIdx.x) / blockDim.x + dist);
        const int64_t k = b + v * kV;
        float x[T][kV];
#pragma unroll
        for (int i = 0; i < T; ++i) {
          const bool f32 = (a.fp32_terms >> i) & 1;
          if (src[i]) {
            load8(x[i], src[i] + (k - r0) * (f32 ? 4 : 2), f32);
          } else {
#pragma unroll
            for (int j = 0; j < kV; ++j) x[i][j] = 0.0f;
          }
        }
        float old[kV];
        float4* d = reinterpret_cast<float4*>(a.dst + k);
        if (a.land && a.accumulate) {
          const float4 o0 = d[0], o1 = d[1];
          old[0] = o0.x; old[1] = o0.y; old[2] = o0.z; old[3] = o0.w;
          old[4] = o1.x; old[5] = o1.y; old[6] = o1.z; old[7] = o1.w;
        }
        float out[kV];
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          float t = 0.0f;
          bool have = false;  // the first present term initialises (no 0.0f + x: keeps -0.0)
#pragma unroll
          for (int i = 0; i < T; ++i)
            if (src[i]) {
              t = have ? __fadd_rn(t, x[i][j]) : x[i][j];
              have = true;
            }
          out[j] = finish(a, t, a.land && a.accumulate ? old[j] : 0.0f);
        }
        d[0] = make_float4(out[0], out[1], out[2], out[3]);
        d[1] = make_float4(out[4], out[5], out[6], out[7]);
      }
    }
    const int64_t head_end = vec ? bv : b;  // scalar head [b, bv) when the body was vectorised
    for (int64_t k0 = threadIdx.x; k0 < (head_end - b) + (e - b_tail); k0 += blockDim.x) {
      const int64_t k = k0 < head_end - b ? b + k0 : b_tail + (k0 - (head_end - b));
      float t = 0.0f;
      bool have = false;
#pragma unroll
      for (int i = 0; i < T; ++i)
        if (src[i]) {
          const float x = load1(src[i], k - r0, (a.fp32_terms >> i) & 1);
          t = have ? __fadd_rn(t, x) : x;
          have = true;
        }
      a.dst[k] = finish(a, t, a.land && a.accumulate ? a.dst[k] : 0.0f);
    }
  }
}

template <int T>
void launch_t(const ReduceArgs& a, int ctas, int l2, cudaStream_t s) {
  reduce_kernel<T><<<ctas, kReduceThreads, 0, s>>>(a, l2);
}

template <int... I>
void reduce_attrs(std::integer_sequence<int, I...>, std::vector<KernelAttrs>* out) {
  auto one = [&](auto kernel, int t) {
    cudaFuncAttributes fa{};
    TIDE_CHECK_CUDA(cudaFuncGetAttributes(&fa, kernel), "cudaFuncGetAttributes(reduce_kernel)");
    out->push_back({"reduce_kernel<" + std::to_string(t) + ">", fa.numRegs, static_cast<int>(fa.localSizeBytes),
                    static_cast<int>(fa.sharedSizeBytes), fa.maxThreadsPerBlock});
  };
  (one(reduce_kernel<I + 1>, I + 1), ...);
}

}  // namespace

void append_reduce_kernel_attrs(std::vector<KernelAttrs>* out) {
  reduce_attrs(std::make_integer_sequence<int, kMaxTerms>{}, out);
}

void launch_reduce(const ReduceArgs& a, int ctas, cudaStream_t stream) {
  TIDE_CHECK(a.n_terms >= 1 && a.n_terms <= kMaxTerms, "REDUCE n_terms=", a.n_terms);
  TIDE_CHECK(a.n == 0 || (a.dst && a.runs && a.n_runs > 0), "REDUCE needs dst and runs");
  if (a.n == 0) return;
  const SumKernel variant = sum_kernel_effective();
  if (variant == SumKernel::kBulk) {
    launch_reduce_bulk(a, ctas, stream);
    return;
  }
  const int l2 = variant == SumKernel::kVecL2 ? 1 : 0;
  int64_t need = (a.n / kV + kReduceThreads) / kReduceThreads;
  const int c = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ctas > 0 ? ctas : 1, need)));
  switch (a.n_terms) {
    case 1: launch_t<1>(a, c, l2, stream); break;
    case 2: launch_t<2>(a, c, l2, stream); break;
    case 3: launch_t<3>(a, c, l2, stream); break;
    case 4: launch_t<4>(a, c, l2, stream); break;
    case 5: launch_t<5>(a, c, l2, stream); break;
    case 6: launch_t<6>(a, c, l2, stream); break;
    case 7: launch_t<7>(a, c, l2, stream); break;
    case 8: launch_t<8>(a, c, l2, stream); break;
    case 9: launch_t<9>(a, c, l2, stream); break;
    case 10: launch_t<10>(a, c, l2, stream); break;
    case 11: launch_t<11>(a, c, l2, stream); break;
    default: launch_t<12>(a, c, l2, stream); break;
  }
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching REDUCE");
}

}  // namespace tide::cuda
