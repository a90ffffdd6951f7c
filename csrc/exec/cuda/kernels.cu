// SUM, CAST and ZERO kernels (see kernels.h for the contract and the fixed association; LAND and
// every other SUM run on REDUCE, reduce.cu).
//
// [Note: work split and CTA retirement]
// SUM splits its element space in tiles or ranges (device.cuh [Note: CTA work split]);
// CAST in contiguous ranges. Each CTA walks only its own pieces, then exits: no persistence and no
// inter-CTA communication, so the CTA budget is an exact upper bound on the SMs a launch occupies
// and every CTA is transient (paper §2.2: short-lived CTAs).
//
// [Note: bytes in flight]
// A memory-bound CTA's rate is bytes-in-flight / latency. SUM issues every load of an
// iteration (n_staged + 1 vectors of 16 B, for sum_unroll() vectors per thread) before the first
// add. The first form (512 threads x 2 vectors: 128 KiB at L = 8) measured 99 GB/s per CTA; now one
// 256-thread CTA keeps up to 256 * 5 * 8 * 16 B = 160 KiB in flight at L = 8, with running
// pointers so the deeper unroll fits the register file without spills.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "exec/cuda/device.cuh"
#include "exec/cuda/graph.h"
#include "exec/cuda/kernels.h"
#include "tide/numerics.h"
#include "tide/errors.h"

namespace tide::cuda {
namespace {

using device::half_hi;
using device::half_lo;
using device::half_to_f32;

constexpr int kVec = 8;  // bf16 (fp16) elements per 16-byte vector

// Vectors per thread per SUM iteration for `terms` operands (staged + own): ~160 registers of
// loaded words (the launch bounds allow 255 at kSumThreads = 256), 1..6. L = 8: 5.
__host__ __device__ constexpr int sum_unroll(int terms) {
  return 160 / (4 * terms) < 1 ? 1 : (160 / (4 * terms) > 6 ? 6 : 160 / (4 * terms));
}


// This CTA's element range [begin, end): contiguous, `align`-aligned start.
__device__ __forceinline__ void cta_range(int64_t n, int64_t align, int64_t* begin, int64_t* end) {
  int64_t per = (n + gridDim.x - 1) / gridDim.x;
  per = (per + align - 1) / align * align;
  *begin = static_cast<int64_t>(blockIdx.x) * per;
  *end = min(n, *begin + per);
}

// Unpack 8 bf16 (fp16) of `v` and add them to acc (acc = acc + x, left to right per element).
template <bool FP16>
__device__ __forceinline__ void add8(float (&acc)[kVec], const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], half_lo<FP16>(w[i]));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], half_hi<FP16>(w[i]));
  }
}
// A direct Level-1 SUM's alpha and accumulate (SumArgs), on the 8 sums about to go to d[0..1].
__device__ __forceinline__ void finish8(const SumArgs& a, float (&acc)[kVec], const float4* d) {
  float old[kVec] = {};
  if (a.accumulate) {
    const float4 o0 = d[0], o1 = d[1];
    old[0] = o0.x; old[1] = o0.y; old[2] = o0.z; old[3] = o0.w;
    old[4] = o1.x; old[5] = o1.y; old[6] = o1.z; old[7] = o1.w;
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    if (a.scale) acc[i] = __fmul_rn(a.alpha, acc[i]);
    if (a.accumulate) acc[i] = __fadd_rn(old[i], acc[i]);
  }
}
template <bool FP16>
__device__ __forceinline__ void set8(float (&acc)[kVec], const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = half_lo<FP16>(w[i]);
    acc[2 * i + 1] = half_hi<FP16>(w[i]);
  }
}

// SUM over elements [begin, end) of the block (one CTA piece: a tile or a range); operands bf16,
// or fp16 (FP16).
template <int NS, bool FP16>
__device__ __forceinline__ void sum_piece(const SumArgs& a, int64_t begin, int64_t end, int vec_ok) {
  // First segment that ends after `begin` (segments are sorted and cover [0, n)).
  int lo = 0, hi = a.n_segs - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a.segs[mid].dst_off + a.segs[mid].len <= begin) lo = mid + 1; else hi = mid;
  }
  for (int si = lo; si < a.n_segs; ++si) {
    const SumSegment sg = a.segs[si];
    if (sg.dst_off >= end) break;
    const int64_t b = max(begin, sg.dst_off);
    const int64_t e = min(end, sg.dst_off + sg.len);
    const uint16_t* own = sg.param >= 0 ? a.grad[sg.param] : nullptr;
    const int64_t shift = sg.src_off - sg.dst_off;  // own index = k + shift
    bool vec = vec_ok && (b % kVec) == 0;
    if (own) vec = vec && (shift % kVec) == 0 && (reinterpret_cast<uintptr_t>(own) & 15) == 0;
    int64_t b_tail = b;
    if (vec) {
      constexpr int U = sum_unroll(NS + 1);
      constexpr int64_t kStep = static_cast<int64_t>(U) * kSumThreads;  // vectors per iteration
      const int64_t nv = (e - b) / kVec;
      b_tail = b + nv * kVec;
      // Running per-thread pointers; vector u of an iteration sits at a constant offset (the
      // launch always has kSumThreads threads), so only NS + 2 pointers stay live.
      const uint4* q[NS > 0 ? NS : 1];
#pragma unroll
      for (int j = 0; j < NS; ++j) q[j] = reinterpret_cast<const uint4*>(a.staged[j] + b) + threadIdx.x;
      const uint4* qo = reinterpret_cast<const uint4*>(own ? own + b + shift : a.staged[0] + b) + threadIdx.x;
      float4* dp = reinterpret_cast<float4*>(a.dst + b) + 2 * threadIdx.x;
      for (int64_t v0 = threadIdx.x; v0 < nv; v0 += kStep) {
        uint4 s[NS > 0 ? NS : 1][U];
        uint4 o[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (v0 + u * kSumThreads < nv) {  // every load of the iteration before the first add
#pragma unroll
            for (int j = 0; j < NS; ++j) s[j][u] = __ldcs(q[j] + u * kSumThreads);
            o[u] = own ? __ldcs(qo + u * kSumThreads) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (v0 + u * kSumThreads < nv) {
            float acc[kVec];
            if (NS > 0) {
              set8<FP16>(acc, s[0][u]);
#pragma unroll
              for (int j = 1; j < NS; ++j) add8<FP16>(acc, s[j][u]);
              if (own) add8<FP16>(acc, o[u]);  // an absent own term is skipped, not added as 0.0f
            } else {
              set8<FP16>(acc, o[u]);
            }
            float4* d = dp + 2 * u * kSumThreads;
            if (a.scale | a.accumulate) finish8(a, acc, d);
            d[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            d[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
          }
        }
#pragma unroll
        for (int j = 0; j < NS; ++j) q[j] += kStep;
        qo += kStep;
        dp += 2 * kStep;
      }
    }
    for (int64_t k = b_tail + threadIdx.x; k < e; k += blockDim.x) {  // scalar remainder
      const float x = own ? half_to_f32<FP16>(own[k + shift]) : 0.0f;
      float acc;
      if (NS > 0) {
        acc = half_to_f32<FP16>(a.staged[0][k]);
#pragma unroll
        for (int j = 1; j < NS; ++j) acc = __fadd_rn(acc, half_to_f32<FP16>(a.staged[j][k]));
        if (own) acc = __fadd_rn(acc, x);
      } else {
        acc = x;
      }
      if (a.scale) acc = __fmul_rn(a.alpha, acc);
      if (a.accumulate) acc = __fadd_rn(a.dst[k], acc);
      a.dst[k] = acc;
    }
  }
}

template <int NS, bool FP16>
__global__ void __launch_bounds__(kSumThreads, 1) sum_kernel(const __grid_constant__ SumArgs a,
                                                          int vec_ok, int split) {
  constexpr int64_t kTile = static_cast<int64_t>(sum_unroll(NS + 1)) * kSumThreads * kVec;  // one iteration
  device::for_each_piece(a.n, kVec, kTile, split == kSplitRanges,
                         [&](int64_t b, int64_t e) { sum_piece<NS, FP16>(a, b, e, vec_ok); });
}

// fp32 -> a 16-bit item: bf16 or fp16 (FP16), round-to-nearest-even (tide/numerics.h).
template <bool FP16>
__device__ __forceinline__ uint16_t to_half(float x) {
  return FP16 ? tide::fp32_to_fp16(x) : tide::fp32_to_bf16(x);
}

template <bool FP16>
__global__ void __launch_bounds__(kCastThreads) cast_kernel(uint16_t* __restrict__ dst,
                                                            const float* __restrict__ src,
                                                            int64_t n, int vec) {
  int64_t begin, end;
  cta_range(n, 4, &begin, &end);
  int64_t b_tail = begin;
  if (vec) {
    const int64_t nv = (end - begin) / 4;
    b_tail = begin + nv * 4;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      const int64_t k = begin + v * 4;
      const float4 x = __ldcs(reinterpret_cast<const float4*>(src + k));
      uint2 o;
      o.x = static_cast<uint32_t>(to_half<FP16>(x.x)) | (static_cast<uint32_t>(to_half<FP16>(x.y)) << 16);
      o.y = static_cast<uint32_t>(to_half<FP16>(x.z)) | (static_cast<uint32_t>(to_half<FP16>(x.w)) << 16);
      *reinterpret_cast<uint2*>(dst + k) = o;
    }
  }
  for (int64_t k = b_tail + threadIdx.x; k < end; k += blockDim.x) dst[k] = to_half<FP16>(src[k]);
}

__global__ void __launch_bounds__(kZeroThreads) zero_kernel(const __grid_constant__ ZeroArgs a) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int r = 0; r < a.n_regions; ++r) {
    char* p = static_cast<char*>(a.regions[r].ptr);
    const int64_t bytes = a.regions[r].bytes;
    const int64_t head = min(bytes, static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15));
    const int64_t nv = (bytes - head) / 16;
    uint4* pv = reinterpret_cast<uint4*>(p + head);
    for (int64_t i = tid; i < nv; i += stride) pv[i] = make_uint4(0, 0, 0, 0);
    const int64_t tail0 = head + nv * 16;
    for (int64_t i = tid; i < head; i += stride) p[i] = 0;
    for (int64_t i = tail0 + tid; i < bytes; i += stride) p[i] = 0;
  }
}

// One 1-D copy of n units of T, grid-strided from unit `tid`: kSmCopyUnroll1d loads in flight
// per thread before their stores. A copy kernel with few CTAs is bound by the bytes it keeps in
// flight, not by instructions (BENCHMARKS.md: ~40 GB/s per CTA at 16 KiB in flight per CTA).
constexpr int kSmCopyUnroll1d = 8;
constexpr int kSmCopyUnroll2d = 4;
template <typename T>
__device__ __forceinline__ void sm_copy_1d(const SmCopy& c, int64_t tid, int64_t stride) {
  const T* __restrict__ src = reinterpret_cast<const T*>(c.src);
  T* __restrict__ dst = reinterpret_cast<T*>(c.dst);
  const int64_t n = c.width / static_cast<int64_t>(sizeof(T));
  for (int64_t i = tid; i < n; i += stride * kSmCopyUnroll1d) {
    T v[kSmCopyUnroll1d];
#pragma unroll
    for (int u = 0; u < kSmCopyUnroll1d; ++u)
      if (i + u * stride < n) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kSmCopyUnroll1d; ++u)
      if (i + u * stride < n) dst[i + u * stride] = v[u];
  }
}

// One 2-D copy in units of T, grid-strided from unit `tid`: a cursor (row, col) steps by the
// stride without a division per unit (q rows and r columns, wrapping at the row's end).
template <typename T>
__device__ __forceinline__ void sm_copy_2d(const SmCopy& c, int64_t tid, int64_t stride) {
  constexpr int64_t kSz = sizeof(T);
  const int64_t per_row = c.width / kSz;
  const int64_t total = per_row * c.height;
  if (tid >= total) return;
  int64_t e = tid;
  int64_t row = tid / per_row;
  int64_t col = tid - row * per_row;
  const int64_t q = stride / per_row;
  const int64_t r = stride - q * per_row;
  while (e < total) {
    T v[kSmCopyUnroll2d];
    int64_t d_at[kSmCopyUnroll2d];
#pragma unroll
    for (int u = 0; u < kSmCopyUnroll2d; ++u) {
      d_at[u] = -1;
      if (e < total) {
        d_at[u] = row * c.dpitch + col * kSz;
        v[u] = __ldcs(reinterpret_cast<const T*>(c.src + row * c.spitch + col * kSz));
        e += stride;
        row += q;
        col += r;
        if (col >= per_row) {
          col -= per_row;
          ++row;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kSmCopyUnroll2d; ++u)
      if (d_at[u] >= 0) *reinterpret_cast<T*>(c.dst + d_at[u]) = v[u];
  }
}

// Every copy of the launch (all of unit T, all 1-D or all 2-D: one instantiation per shape keeps
// the registers of the path it runs), one after the other, each over the whole grid (threads past
// a small copy's end skip it).
template <typename T, bool kStrided>
__global__ void __launch_bounds__(kCopyThreads) sm_copy_kernel(const __grid_constant__ SmCopyArgs a) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int i = 0; i < a.n; ++i) {
    if constexpr (kStrided) sm_copy_2d<T>(a.copies[i], tid, stride);
    else sm_copy_1d<T>(a.copies[i], tid, stride);
  }
}

// The instantiation for copies of `vec`-byte units, strided or not.
using SmCopyKernel = void (*)(SmCopyArgs);
template <bool kStrided>
SmCopyKernel sm_copy_kernel_for(int vec) {
  switch (vec) {
    case 16: return sm_copy_kernel<uint4, kStrided>;
    case 8: return sm_copy_kernel<uint2, kStrided>;
    case 4: return sm_copy_kernel<unsigned int, kStrided>;
    case 2: return sm_copy_kernel<unsigned short, kStrided>;
    default: return sm_copy_kernel<unsigned char, kStrided>;
  }
}
SmCopyKernel sm_copy_kernel_for(int vec, bool strided) {
  return strided ? sm_copy_kernel_for<true>(vec) : sm_copy_kernel_for<false>(vec);
}

int clamp_ctas(int ctas, int64_t work_items, int threads) {
  const int64_t need = (work_items + threads - 1) / threads;
  int64_t c = ctas > 0 ? ctas : 1;
  if (need < c) c = need > 0 ? need : 1;
  return static_cast<int>(c);
}

template <int NS, bool FP16>
void launch_sum_nsh(const SumArgs& a, int ctas, int vec_ok, const LaunchKnobs& k, cudaStream_t s) {
  constexpr int64_t kTile = static_cast<int64_t>(sum_unroll(NS + 1)) * kSumThreads * kVec;  // sum_kernel's
  const int grid = grid_for(reinterpret_cast<const void*>(sum_kernel<NS, FP16>), kSumThreads, ctas, a.n, kTile, k);
  sum_kernel<NS, FP16><<<grid, kSumThreads, 0, s>>>(a, vec_ok, split_for(grid, k));
}
template <int NS>
void launch_sum_ns(const SumArgs& a, int ctas, int vec_ok, const LaunchKnobs& k, cudaStream_t s) {
  if (a.fp16)
    launch_sum_nsh<NS, true>(a, ctas, vec_ok, k, s);
  else
    launch_sum_nsh<NS, false>(a, ctas, vec_ok, k, s);
}

template <int... I>
void sum_attrs(std::integer_sequence<int, I...>, std::vector<KernelAttrs>* out) {
  auto one = [&](auto kernel, int ns, bool fp16) {
    cudaFuncAttributes fa{};
    TIDE_CHECK_CUDA(cudaFuncGetAttributes(&fa, kernel), "cudaFuncGetAttributes(sum_kernel)");
    out->push_back({"sum_kernel<" + std::to_string(ns) + (fp16 ? ",fp16>" : ">"), fa.numRegs,
                    static_cast<int>(fa.localSizeBytes), static_cast<int>(fa.sharedSizeBytes), fa.maxThreadsPerBlock});
  };
  (one(sum_kernel<I, false>, I, false), ...);
  (one(sum_kernel<I, true>, I, true), ...);
}

__global__ void stall_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(100000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

}  // namespace

// Fault injection only (ExecOptions::stall_rank): one thread sleeps `seconds` on `stream`.
void launch_stall(double seconds, cudaStream_t stream) {
  stall_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(seconds * 1e9));
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching the stall kernel");
}


int resident_per_sm(const void* kernel, int threads) {
  int k = 0;
  TIDE_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k, kernel, threads, 0), "occupancy of a TIDE kernel");
  return k;
}

int grid_for(const void* kernel, int threads, int ctas, int64_t n, int64_t tile, const LaunchKnobs& k) {
  if (split_for(ctas, k) != kSplitTiles || k.full_grid != FullGrid::kTiles) return ctas;
  int dev = 0;
  TIDE_CHECK_CUDA(cudaGetDevice(&dev));
  int wave = 0;
  {
    // One resident wave per (kernel, device), computed once: the occupancy query is not free.
    static std::mutex mu;
    static std::map<std::pair<const void*, int>, int> waves;
    std::lock_guard<std::mutex> g(mu);
    auto it = waves.find({kernel, dev});
    if (it == waves.end()) {
      int sms = 0;
      TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SMs of device ", dev);
      it = waves.emplace(std::make_pair(kernel, dev), std::max(1, resident_per_sm(kernel, threads)) * sms).first;
    }
    wave = it->second;
  }
  if (ctas < wave) return ctas;
  const int64_t tiles = (n + tile - 1) / tile;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(tiles, ctas), INT32_MAX));
}

int split_for(int ctas, const LaunchKnobs& k) {
  // A few CTAs are latency-bound and open few DRAM streams anyway; one long range each keeps
  // their per-CTA rate (BENCHMARKS.md: tiles cost ~10 % per CTA at 1-16 CTAs).
  if (k.split == CtaSplit::kTiles) return kSplitTiles;
  if (k.split == CtaSplit::kRanges) return kSplitRanges;
  return ctas >= kTilesMinCtas ? kSplitTiles : kSplitRanges;
}

std::vector<KernelAttrs> sum_kernel_attrs() {
  std::vector<KernelAttrs> v;
  sum_attrs(std::make_integer_sequence<int, kMaxStaged + 1>{}, &v);
  append_reduce_kernel_attrs(&v);
  return v;
}

void preload_kernels(int device) {
  static std::mutex mu;
  static std::set<int> loaded;
  std::lock_guard<std::mutex> g(mu);
  if (loaded.count(device)) return;
  int prev = 0;
  TIDE_CHECK_CUDA(cudaGetDevice(&prev));
  TIDE_CHECK_CUDA(cudaSetDevice(device), "device ", device);
  // cudaFuncGetAttributes loads a lazily loaded kernel: SUM and REDUCE here...
  (void)sum_kernel_attrs();
  // ...and the others.
  std::vector<const void*> rest = {reinterpret_cast<const void*>(cast_kernel<false>),
                                   reinterpret_cast<const void*>(cast_kernel<true>), reinterpret_cast<const void*>(zero_kernel),
                                   reinterpret_cast<const void*>(stall_kernel)};
  for (int vec = 1; vec <= 16; vec *= 2)
    for (bool strided : {false, true}) rest.push_back(reinterpret_cast<const void*>(sm_copy_kernel_for(vec, strided)));
  for (const void* k : graph_kernels()) rest.push_back(k);  // graph.h
  for (const void* k : rest) {
    cudaFuncAttributes fa{};
    TIDE_CHECK_CUDA(cudaFuncGetAttributes(&fa, k), "loading the TIDE kernels on device ", device);
  }
  TIDE_CHECK_CUDA(cudaSetDevice(prev));
  loaded.insert(device);
}

void launch_sum(const SumArgs& a, int ctas, const LaunchKnobs& knobs, cudaStream_t stream) {
  TIDE_CHECK(a.n_staged >= 0 && a.n_staged <= kMaxStaged, "n_staged=", a.n_staged);
  TIDE_CHECK(a.n == 0 || (a.dst && a.segs && a.n_segs > 0), "SUM needs dst and a segment table");
  if (a.n == 0) return;
  int vec_ok = (reinterpret_cast<uintptr_t>(a.dst) & 15) == 0;
  for (int j = 0; j < a.n_staged; ++j) {
    TIDE_CHECK(a.staged[j] != nullptr, "staged slice ", j, " is null");
    vec_ok = vec_ok && (reinterpret_cast<uintptr_t>(a.staged[j]) & 15) == 0;
  }
  const int c = clamp_ctas(ctas, a.n / kVec + 1, kSumThreads);
  switch (a.n_staged) {
    case 0: launch_sum_ns<0>(a, c, vec_ok, knobs, stream); break;
    case 1: launch_sum_ns<1>(a, c, vec_ok, knobs, stream); break;
    case 2: launch_sum_ns<2>(a, c, vec_ok, knobs, stream); break;
    case 3: launch_sum_ns<3>(a, c, vec_ok, knobs, stream); break;
    case 4: launch_sum_ns<4>(a, c, vec_ok, knobs, stream); break;
    case 5: launch_sum_ns<5>(a, c, vec_ok, knobs, stream); break;
    case 6: launch_sum_ns<6>(a, c, vec_ok, knobs, stream); break;
    default: launch_sum_ns<7>(a, c, vec_ok, knobs, stream); break;
  }
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching SUM");
}

template <int... I>
int sum_occupancy(std::integer_sequence<int, I...>, int n_staged) {
  int k = 0;
  auto one = [&](auto kernel, int ns) {
    if (ns == n_staged) k = resident_per_sm(reinterpret_cast<const void*>(kernel), kSumThreads);
  };
  (one(sum_kernel<I, false>, I), ...);  // the bf16 form (sum_kernel_attrs lists both forms)
  return k;
}

int resident_ctas_per_sm(const std::string& kernel, int n_staged) {
  if (kernel == "sum") {
    TIDE_PLAN_CHECK(n_staged >= 0 && n_staged <= kMaxStaged, "resident_ctas_per_sm: n_staged ", n_staged,
                    " outside [0, ", kMaxStaged, "]");
    return sum_occupancy(std::make_integer_sequence<int, kMaxStaged + 1>{}, n_staged);
  }
  TIDE_PLAN_CHECK(kernel == "reduce" || kernel == "reduce_fp32", "resident_ctas_per_sm: kernel must be 'sum', "
                  "'reduce' or 'reduce_fp32', got '", kernel, "'");
  return reduce_resident_ctas_per_sm(n_staged, kernel == "reduce_fp32");
}

void launch_cast(uint16_t* dst, const float* src, int64_t n, int ctas, cudaStream_t stream, bool fp16) {
  if (n == 0) return;
  const int vec = (reinterpret_cast<uintptr_t>(dst) & 7) == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  const int grid = clamp_ctas(ctas, n / 4 + 1, kCastThreads);
  if (fp16)
    cast_kernel<true><<<grid, kCastThreads, 0, stream>>>(dst, src, n, vec);
  else
    cast_kernel<false><<<grid, kCastThreads, 0, stream>>>(dst, src, n, vec);
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching CAST");
}

void launch_zero(const ZeroArgs& a, int ctas, cudaStream_t stream) {
  TIDE_CHECK(a.n_regions >= 0 && a.n_regions <= kMaxZeroRegions, "n_regions=", a.n_regions);
  int64_t bytes = 0;
  for (int i = 0; i < a.n_regions; ++i) bytes += a.regions[i].bytes;
  if (bytes == 0) return;
  zero_kernel<<<clamp_ctas(ctas, bytes / 16 + 1, kZeroThreads), kZeroThreads, 0, stream>>>(a);
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching ZERO");
}

int sm_copy_vec(const void* dst, const void* src, int64_t width, int64_t height, int64_t dpitch, int64_t spitch) {
  uint64_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uint64_t>(width);
  if (height > 1) bits |= static_cast<uint64_t>(dpitch) | static_cast<uint64_t>(spitch);
  for (int v = 16; v > 1; v /= 2)
    if ((bits & static_cast<uint64_t>(v - 1)) == 0) return v;
  return 1;
}

void launch_sm_copies(const SmCopyArgs& a, int ctas, cudaStream_t stream) {
  TIDE_CHECK(a.n >= 0 && a.n <= kMaxSmCopies, "COPY on SMs: ", a.n, " copies (at most ", kMaxSmCopies, ")");
  // One launch per shape (unit, strided) present, each with that shape's copies.
  for (int vec = 1; vec <= 16; vec *= 2) {
    for (bool strided : {false, true}) {
      SmCopyArgs part;
      int64_t units = 0;
      for (int i = 0; i < a.n; ++i) {
        const SmCopy& c = a.copies[i];
        TIDE_CHECK(c.vec >= 1 && c.vec <= 16 && c.width % c.vec == 0, "COPY on SMs: copy ", i, " of width ",
                   c.width, " in units of ", c.vec);
        if (c.vec != vec || (c.height > 1) != strided || c.width == 0 || c.height == 0) continue;
        part.copies[part.n++] = c;
        units = std::max<int64_t>(units, c.width / c.vec * c.height);
      }
      if (part.n == 0) continue;
      const int per_thread = strided ? kSmCopyUnroll2d : kSmCopyUnroll1d;
      const int grid = clamp_ctas(ctas, (units + per_thread - 1) / per_thread, kCopyThreads);
      sm_copy_kernel_for(vec, strided)<<<grid, kCopyThreads, 0, stream>>>(part);
      TIDE_CHECK_CUDA(cudaGetLastError(), "launching COPY on SMs (", vec, "-byte units", strided ? ", strided" : "",
                      ")");
    }
  }
}

}  // namespace tide::cuda
