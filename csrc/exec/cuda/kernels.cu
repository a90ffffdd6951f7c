// SUM, LAND, CAST and ZERO kernels (see kernels.h for the contract and the fixed association).
//
// [Note: work split and CTA retirement]
// SUM and LAND split their element space in tiles or ranges (device.cuh [Note: CTA work split]);
// CAST in contiguous ranges. Each CTA walks only its own pieces, then exits: no persistence and no
// inter-CTA communication, so the CTA budget is an exact upper bound on the SMs a launch occupies
// and every CTA is transient (paper §2.2: short-lived CTAs).
//
// [Note: bytes in flight]
// A memory-bound CTA's rate is bytes-in-flight / latency. SUM issues every load of an
// iteration (n_staged + 1 vectors of 16 B, for sum_unroll() vectors per thread) before the first
// add. Run 2-5 (512 threads x 2 vectors: 128 KiB at L = 8) measured 99 GB/s per CTA; now one
// 256-thread CTA keeps up to 256 * 5 * 8 * 16 B = 160 KiB in flight at L = 8, with running
// pointers so the deeper unroll fits the register file without spills.
// TIDE_SUM_KERNEL picks this kernel (`vec`), it with the L2 prefetch (`vec_l2`) or the bulk
// pipeline of bulk.cu (`bulk`); kernels.h.
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
#include "exec/cuda/kernels.h"
#include "tide/errors.h"

namespace tide::cuda {
namespace {

using device::bf16_hi;
using device::bf16_lo;
using device::l2_prefetch;
using device::prefetch_dist;

constexpr int kVec = 8;  // bf16 elements per 16-byte vector

// Vectors per thread per SUM iteration for `terms` operands (staged + own): ~160 registers of
// loaded words (the launch bounds allow 255 at kSumThreads = 256), 1..6. L = 8: 5.
__host__ __device__ constexpr int sum_unroll(int terms) {
  return 160 / (4 * terms) < 1 ? 1 : (160 / (4 * terms) > 6 ? 6 : 160 / (4 * terms));
}

__device__ __forceinline__ float bf16_to_f(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

__host__ __device__ __forceinline__ uint16_t f_to_bf16(float f) {
#ifdef __CUDA_ARCH__
  uint32_t u = __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
#endif
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}


// This CTA's element range [begin, end): contiguous, `align`-aligned start.
__device__ __forceinline__ void cta_range(int64_t n, int64_t align, int64_t* begin, int64_t* end) {
  int64_t per = (n + gridDim.x - 1) / gridDim.x;
  per = (per + align - 1) / align * align;
  *begin = static_cast<int64_t>(blockIdx.x) * per;
  *end = min(n, *begin + per);
}

// Unpack 8 bf16 of `v` and add them to acc (acc = acc + x, left to right per element).
__device__ __forceinline__ void add8(float (&acc)[kVec], const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], bf16_lo(w[i]));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], bf16_hi(w[i]));
  }
}
__device__ __forceinline__ void set8(float (&acc)[kVec], const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = bf16_lo(w[i]);
    acc[2 * i + 1] = bf16_hi(w[i]);
  }
}

// SUM over elements [begin, end) of the block (one CTA piece: a tile or a range).
template <int NS>
__device__ __forceinline__ void sum_piece(const SumArgs& a, int64_t begin, int64_t end, int vec_ok, int l2) {
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
      const int64_t chunk = kStep * kVec;  // elements per iteration
      const int dist = prefetch_dist();
      auto prefetch = [&](int64_t it) {  // operands of iteration `it`, one thread per operand
        const int64_t first = it * chunk;
        const int64_t span = min(chunk, nv * kVec - first);
        if (span <= 0 || static_cast<int>(threadIdx.x) > NS) return;
        if (static_cast<int>(threadIdx.x) < NS) l2_prefetch(a.staged[threadIdx.x] + b + first, span * 2);
        else if (own) l2_prefetch(own + b + first + shift, span * 2);
      };
      if (l2)
        for (int d = 0; d < dist; ++d) prefetch(d);
      // Running per-thread pointers; vector u of an iteration sits at a constant offset (the
      // launch always has kSumThreads threads), so only NS + 2 pointers stay live.
      const uint4* q[NS > 0 ? NS : 1];
#pragma unroll
      for (int j = 0; j < NS; ++j) q[j] = reinterpret_cast<const uint4*>(a.staged[j] + b) + threadIdx.x;
      const uint4* qo = reinterpret_cast<const uint4*>(own ? own + b + shift : a.staged[0] + b) + threadIdx.x;
      float4* dp = reinterpret_cast<float4*>(a.dst + b) + 2 * threadIdx.x;
      for (int64_t v0 = threadIdx.x, it = 0; v0 < nv; v0 += kStep, ++it) {
        if (l2) prefetch(it + dist);
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
              set8(acc, s[0][u]);
#pragma unroll
              for (int j = 1; j < NS; ++j) add8(acc, s[j][u]);
              if (own) add8(acc, o[u]);  // an absent own term is skipped, not added as 0.0f
            } else {
              set8(acc, o[u]);
            }
            float4* d = dp + 2 * u * kSumThreads;
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
      const float x = own ? bf16_to_f(own[k + shift]) : 0.0f;
      float acc;
      if (NS > 0) {
        acc = bf16_to_f(a.staged[0][k]);
#pragma unroll
        for (int j = 1; j < NS; ++j) acc = __fadd_rn(acc, bf16_to_f(a.staged[j][k]));
        if (own) acc = __fadd_rn(acc, x);
      } else {
        acc = x;
      }
      a.dst[k] = acc;
    }
  }
}

template <int NS>
__global__ void __launch_bounds__(kSumThreads, 1) sum_kernel(const __grid_constant__ SumArgs a,
                                                          int vec_ok, int l2, int split) {
  constexpr int64_t kTile = static_cast<int64_t>(sum_unroll(NS + 1)) * kSumThreads * kVec;  // one iteration
  device::for_each_piece(a.n, kVec, kTile, split == kCtaRanges,
                         [&](int64_t b, int64_t e) { sum_piece<NS>(a, b, e, vec_ok, l2); });
}

__device__ __forceinline__ float land_one(const LandJob& j, int64_t k, float alpha, int acc_mode) {
  float t = j.src[0][k];
  for (int i = 1; i < j.n_src; ++i) t = __fadd_rn(t, j.src[i][k]);
  const float v = __fmul_rn(alpha, t);
  return acc_mode ? __fadd_rn(j.dst[k], v) : v;
}

// The aligned body of one LAND job over [b, b + 4 nv): KU vectors per thread per iteration, each
// reading up to KS sources, every load issued before the first add. KU * KS = 16 float4 in flight
// per thread at most (one source: 8 vectors; two: 6; four: 4; eight: 2), so a one-source landing
// (the single-node case) is not latency-bound on 2 loads per thread. ACC < 0 reads accumulate at
// run time (its old words are 16 more float4 of registers); ACC = 0 drops them, which leaves room
// for the one-source, overwrite landing to keep 16 vectors in flight (land_kernel<16, 1, 0>: a
// 128 KiB tile per 512-thread CTA; one CTA per SM waits one HBM latency per tile, so the deeper
// tile was predicted to halve that bubble's share; measured 1-2 % faster, BENCHMARKS.md Runs
// 26-27; a wide form, two 64-register CTAs per SM with 4 vectors each, was slower still and
// dropped). Same association for every instantiation: ((s0 + s1) + ...) * alpha [+ old].
// `ahead`: prefetch `dist` iterations ahead inside this piece (a range); a tile is one iteration,
// so the tile loop prefetches the CTA's next tile instead (land_prefetch).
template <int KU, int KS, int ACC>
__device__ __forceinline__ void land_vec(const LandJob& j, const LandArgs& a, int64_t b, int64_t nv, bool ahead) {
  const bool acc = ACC < 0 ? a.accumulate != 0 : ACC != 0;
  const int64_t chunk = static_cast<int64_t>(KU) * blockDim.x * 4;  // elements per iteration
  const int dist = ahead ? prefetch_dist() : 0;
  auto prefetch = [&](int64_t it) {
    const int64_t first = it * chunk;
    const int64_t span = min(chunk, nv * 4 - first);
    if (span <= 0) return;
    const int t = static_cast<int>(threadIdx.x);
    if (t < j.n_src) l2_prefetch(j.src[t] + b + first, span * 4);
    else if (t == j.n_src && acc) l2_prefetch(j.dst + b + first, span * 4);
  };
  for (int d = 0; d < dist; ++d) prefetch(d);
  for (int64_t v0 = threadIdx.x; v0 < nv; v0 += KU * blockDim.x) {
    if (ahead) prefetch((v0 - threadIdx.x) / (KU * blockDim.x) + dist);
    float4 in[KU][KS];
    float4 old[KU];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
      if (v < nv) {
        const int64_t k = b + v * 4;
#pragma unroll
        for (int i = 0; i < KS; ++i)
          if (i < j.n_src) in[u][i] = __ldcs(reinterpret_cast<const float4*>(j.src[i] + k));
        if (acc) old[u] = *reinterpret_cast<const float4*>(j.dst + k);
      }
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
      if (v >= nv) continue;
      const int64_t k = b + v * 4;
      float4 t = in[u][0];
#pragma unroll
      for (int i = 1; i < KS; ++i) {
        if (i < j.n_src) {
          t.x = __fadd_rn(t.x, in[u][i].x);
          t.y = __fadd_rn(t.y, in[u][i].y);
          t.z = __fadd_rn(t.z, in[u][i].z);
          t.w = __fadd_rn(t.w, in[u][i].w);
        }
      }
      float4 v4 = make_float4(__fmul_rn(a.alpha, t.x), __fmul_rn(a.alpha, t.y), __fmul_rn(a.alpha, t.z),
                              __fmul_rn(a.alpha, t.w));
      if (acc)
        v4 = make_float4(__fadd_rn(old[u].x, v4.x), __fadd_rn(old[u].y, v4.y), __fadd_rn(old[u].z, v4.z),
                         __fadd_rn(old[u].w, v4.w));
      *reinterpret_cast<float4*>(j.dst + k) = v4;
    }
  }
}

// f(job, b, e) for each job's part [b, e) (job-relative) of elements [begin, end) of the jobs
// laid end to end, each padded to a multiple of 4 elements.
template <class F>
__device__ __forceinline__ void for_each_job_part(const LandArgs& a, int64_t begin, int64_t end, F&& f) {
  int64_t base = 0;
  for (int ji = 0; ji < a.n_jobs && base < end; ++ji) {
    const LandJob& j = a.jobs[ji];
    const int64_t padded = (j.n + 3) & ~int64_t(3);
    const int64_t b = max(begin, base) - base;
    const int64_t e = min(min(end, base + padded) - base, j.n);
    base += padded;
    if (b < e) f(j, b, e);
  }
}

// One instantiation per source bound KS (launch_land picks it from the jobs' largest n_src), so
// each gets its own register allocation. LAND over elements [begin, end) of the jobs.
template <int KU, int KS, int ACC>
__device__ __forceinline__ void land_piece(const LandArgs& a, int64_t begin, int64_t end, bool ahead) {
  for_each_job_part(a, begin, end, [&](const LandJob& j, int64_t b, int64_t e) {
    bool vec = (reinterpret_cast<uintptr_t>(j.dst) & 15) == 0;
    for (int i = 0; i < j.n_src; ++i) vec = vec && (reinterpret_cast<uintptr_t>(j.src[i]) & 15) == 0;
    int64_t b_tail = b;
    if (vec) {
      const int64_t nv = (e - b) / 4;
      b_tail = b + nv * 4;
      land_vec<KU, KS, ACC>(j, a, b, nv, ahead);
    }
    const int acc = ACC < 0 ? a.accumulate : ACC;
    for (int64_t k = b_tail + threadIdx.x; k < e; k += blockDim.x) j.dst[k] = land_one(j, k, a.alpha, acc);
  });
}

// L2 prefetch of the operands of elements [begin, end) (one thread per source, one for the
// accumulated dst): the CTA's next tile, requested before this tile's loads so that its loads
// find L2 instead of waiting a full HBM latency once per tile (one CTA per SM leaves nobody to
// fill that gap).
__device__ __forceinline__ void land_prefetch(const LandArgs& a, int64_t begin, int64_t end) {
  const int t = static_cast<int>(threadIdx.x);
  if (t > kMaxLandSrcs) return;
  for_each_job_part(a, begin, end, [&](const LandJob& j, int64_t b, int64_t e) {
    if (t < j.n_src) l2_prefetch(j.src[t] + b, (e - b) * 4);
    else if (t == j.n_src && a.accumulate) l2_prefetch(j.dst + b, (e - b) * 4);
  });
}

template <int KU, int KS, int ACC = -1>
__global__ void __launch_bounds__(kLandThreads) land_kernel(const __grid_constant__ LandArgs a,
                                                            int64_t total, int split) {
  const int64_t tile = static_cast<int64_t>(KU) * blockDim.x * 4;  // one land_vec iteration
  const bool ranges = split == kCtaRanges;
  device::for_each_piece(total, 4, tile, ranges, [&](int64_t b, int64_t e) {
    if (!ranges) land_prefetch(a, b + gridDim.x * tile, min(total, b + (gridDim.x + 1) * tile));
    land_piece<KU, KS, ACC>(a, b, e, ranges);
  });
}

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
      o.x = static_cast<uint32_t>(f_to_bf16(x.x)) | (static_cast<uint32_t>(f_to_bf16(x.y)) << 16);
      o.y = static_cast<uint32_t>(f_to_bf16(x.z)) | (static_cast<uint32_t>(f_to_bf16(x.w)) << 16);
      *reinterpret_cast<uint2*>(dst + k) = o;
    }
  }
  for (int64_t k = b_tail + threadIdx.x; k < end; k += blockDim.x) dst[k] = f_to_bf16(src[k]);
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

int clamp_ctas(int ctas, int64_t work_items, int threads) {
  const int64_t need = (work_items + threads - 1) / threads;
  int64_t c = ctas > 0 ? ctas : 1;
  if (need < c) c = need > 0 ? need : 1;
  return static_cast<int>(c);
}

template <int NS>
void launch_sum_ns(const SumArgs& a, int ctas, int vec_ok, int l2, cudaStream_t s) {
  constexpr int64_t kTile = static_cast<int64_t>(sum_unroll(NS + 1)) * kSumThreads * kVec;  // sum_kernel's
  const int grid = grid_for(reinterpret_cast<const void*>(sum_kernel<NS>), kSumThreads, ctas, a.n, kTile);
  sum_kernel<NS><<<grid, kSumThreads, 0, s>>>(a, vec_ok, l2, cta_split_for(grid));
}

template <int... I>
void sum_attrs(std::integer_sequence<int, I...>, std::vector<KernelAttrs>* out) {
  auto one = [&](auto kernel, int ns) {
    cudaFuncAttributes fa{};
    TIDE_CHECK_CUDA(cudaFuncGetAttributes(&fa, kernel), "cudaFuncGetAttributes(sum_kernel)");
    out->push_back({"sum_kernel<" + std::to_string(ns) + ">", fa.numRegs, static_cast<int>(fa.localSizeBytes),
                    static_cast<int>(fa.sharedSizeBytes), fa.maxThreadsPerBlock});
  };
  (one(sum_kernel<I>, I), ...);
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

uint16_t float_to_bf16_rne(float f) { return f_to_bf16(f); }

const char* sum_kernel_name(SumKernel k) {
  switch (k) {
    case SumKernel::kVecL2: return "vec_l2";
    case SumKernel::kBulk: return "bulk";
    default: return "vec";
  }
}

SumKernel sum_kernel_requested() {
  // Read at every launch (a getenv, no allocation), so a process can sweep the variants.
  const char* v = std::getenv("TIDE_SUM_KERNEL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "vec") == 0) return SumKernel::kVec;
  if (std::strcmp(v, "vec_l2") == 0) return SumKernel::kVecL2;
  if (std::strcmp(v, "bulk") == 0) return SumKernel::kBulk;
  TIDE_PLAN_CHECK(false, "TIDE_SUM_KERNEL=", v, ": expected vec, vec_l2 or bulk");
  return SumKernel::kVec;
}

CtaSplit cta_split() {
  // Read at every launch, as TIDE_SUM_KERNEL: a process can compare the two splits.
  const char* v = std::getenv("TIDE_CTA_SPLIT");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return kCtaAuto;
  if (std::strcmp(v, "tiles") == 0) return kCtaTiles;
  TIDE_PLAN_CHECK(std::strcmp(v, "ranges") == 0, "TIDE_CTA_SPLIT=", v, ": expected auto, tiles or ranges");
  return kCtaRanges;
}

bool land_deep() {
  // Read at every launch, as TIDE_CTA_SPLIT: the layout bench compares both tiles.
  const char* v = std::getenv("TIDE_LAND_DEEP");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "1") == 0) return true;
  TIDE_PLAN_CHECK(std::strcmp(v, "0") == 0, "TIDE_LAND_DEEP=", v, ": expected 0 or 1");
  return false;
}

int resident_per_sm(const void* kernel, int threads) {
  int k = 0;
  TIDE_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k, kernel, threads, 0), "occupancy of a TIDE kernel");
  return k;
}

bool full_grid_tiles() {
  const char* v = std::getenv("TIDE_FULL_GRID");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "tiles") == 0) return true;
  TIDE_PLAN_CHECK(std::strcmp(v, "wave") == 0, "TIDE_FULL_GRID=", v, ": expected tiles or wave");
  return false;
}

int grid_for(const void* kernel, int threads, int ctas, int64_t n, int64_t tile) {
  if (cta_split_for(ctas) != kCtaTiles || !full_grid_tiles()) return ctas;
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

CtaSplit cta_split_for(int ctas) {
  // A few CTAs are latency-bound and open few DRAM streams anyway; one long range each keeps
  // their per-CTA rate (BENCHMARKS.md Run 21: tiles cost ~10 % per CTA at 1-16 CTAs).
  const CtaSplit s = cta_split();
  return s != kCtaAuto ? s : (ctas >= kTilesMinCtas ? kCtaTiles : kCtaRanges);
}

SumKernel sum_kernel_effective() {
  const SumKernel k = sum_kernel_requested();
  return k == SumKernel::kBulk && !bulk_supported() ? SumKernel::kVec : k;
}

std::vector<KernelAttrs> sum_kernel_attrs() {
  std::vector<KernelAttrs> v;
  sum_attrs(std::make_integer_sequence<int, kMaxStaged + 1>{}, &v);
  append_reduce_kernel_attrs(&v);
  append_bulk_kernel_attrs(&v);
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
  // cudaFuncGetAttributes loads a lazily loaded kernel: SUM, REDUCE and bulk here...
  (void)sum_kernel_attrs();
  // ...and the others.
  const void* rest[] = {reinterpret_cast<const void*>(land_kernel<16, 1, 0>),
                        reinterpret_cast<const void*>(land_kernel<8, 1>), reinterpret_cast<const void*>(land_kernel<6, 2>),
                        reinterpret_cast<const void*>(land_kernel<4, 4>), reinterpret_cast<const void*>(land_kernel<2, 8>),
                        reinterpret_cast<const void*>(cast_kernel), reinterpret_cast<const void*>(zero_kernel),
                        reinterpret_cast<const void*>(stall_kernel)};
  for (const void* k : rest) {
    cudaFuncAttributes fa{};
    TIDE_CHECK_CUDA(cudaFuncGetAttributes(&fa, k), "loading the TIDE kernels on device ", device);
  }
  TIDE_CHECK_CUDA(cudaSetDevice(prev));
  loaded.insert(device);
}

void launch_sum(const SumArgs& a, int ctas, cudaStream_t stream) {
  TIDE_CHECK(a.n_staged >= 0 && a.n_staged <= kMaxStaged, "n_staged=", a.n_staged);
  TIDE_CHECK(a.n == 0 || (a.dst && a.segs && a.n_segs > 0), "SUM needs dst and a segment table");
  if (a.n == 0) return;
  int vec_ok = (reinterpret_cast<uintptr_t>(a.dst) & 15) == 0;
  for (int j = 0; j < a.n_staged; ++j) {
    TIDE_CHECK(a.staged[j] != nullptr, "staged slice ", j, " is null");
    vec_ok = vec_ok && (reinterpret_cast<uintptr_t>(a.staged[j]) & 15) == 0;
  }
  const SumKernel variant = sum_kernel_effective();
  if (variant == SumKernel::kBulk) {
    launch_sum_bulk(a, ctas, stream);
    return;
  }
  const int l2 = variant == SumKernel::kVecL2 ? 1 : 0;
  const int c = clamp_ctas(ctas, a.n / kVec + 1, kSumThreads);
  switch (a.n_staged) {
    case 0: launch_sum_ns<0>(a, c, vec_ok, l2, stream); break;
    case 1: launch_sum_ns<1>(a, c, vec_ok, l2, stream); break;
    case 2: launch_sum_ns<2>(a, c, vec_ok, l2, stream); break;
    case 3: launch_sum_ns<3>(a, c, vec_ok, l2, stream); break;
    case 4: launch_sum_ns<4>(a, c, vec_ok, l2, stream); break;
    case 5: launch_sum_ns<5>(a, c, vec_ok, l2, stream); break;
    case 6: launch_sum_ns<6>(a, c, vec_ok, l2, stream); break;
    default: launch_sum_ns<7>(a, c, vec_ok, l2, stream); break;
  }
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching SUM");
}

// A LAND instantiation and its tile (KU vectors of 4 elements per thread: land_kernel's).
struct LandKernel {
  void (*fn)(LandArgs, int64_t, int);
  int ku;
};
// static_assert below: the instantiations cover 1, 2, 4 and kMaxLandSrcs = 8 sources.
LandKernel land_kernel_for(int max_src, bool accumulate) {
  static_assert(kMaxLandSrcs == 8, "land_kernel_for covers 1, 2, 4 and 8 sources");
  if (max_src <= 1 && !accumulate && land_deep()) return {land_kernel<16, 1, 0>, 16};
  if (max_src <= 1) return {land_kernel<8, 1>, 8};
  if (max_src <= 2) return {land_kernel<6, 2>, 6};
  if (max_src <= 4) return {land_kernel<4, 4>, 4};
  return {land_kernel<2, 8>, 2};
}

template <int... I>
int sum_occupancy(std::integer_sequence<int, I...>, int n_staged) {
  int k = 0;
  auto one = [&](auto kernel, int ns) {
    if (ns == n_staged) k = resident_per_sm(reinterpret_cast<const void*>(kernel), kSumThreads);
  };
  (one(sum_kernel<I>, I), ...);
  return k;
}

int resident_ctas_per_sm(const std::string& kernel, int n_staged) {
  if (kernel == "sum") {
    TIDE_PLAN_CHECK(n_staged >= 0 && n_staged <= kMaxStaged, "resident_ctas_per_sm: n_staged ", n_staged,
                    " outside [0, ", kMaxStaged, "]");
    return sum_occupancy(std::make_integer_sequence<int, kMaxStaged + 1>{}, n_staged);
  }
  if (kernel == "reduce" || kernel == "reduce_fp32") return reduce_resident_ctas_per_sm(n_staged, kernel == "reduce_fp32");
  TIDE_PLAN_CHECK(kernel == "land", "resident_ctas_per_sm: kernel must be 'sum', 'land', 'reduce' or 'reduce_fp32', got '",
                  kernel, "'");
  return resident_per_sm(reinterpret_cast<const void*>(land_kernel_for(std::max(1, n_staged), false).fn), kLandThreads);
}

void launch_land(const LandArgs& a, int ctas, cudaStream_t stream) {
  TIDE_CHECK(a.n_jobs >= 0 && a.n_jobs <= kMaxLandJobs, "n_jobs=", a.n_jobs);
  int64_t total = 0;
  int max_src = 1;
  for (int i = 0; i < a.n_jobs; ++i) {
    const LandJob& j = a.jobs[i];
    TIDE_CHECK(j.n_src >= 1 && j.n_src <= kMaxLandSrcs, "job ", i, " n_src=", j.n_src);
    TIDE_CHECK(j.n == 0 || j.dst, "job ", i, " has no dst");
    total += (j.n + 3) & ~int64_t(3);
    max_src = std::max(max_src, j.n_src);
  }
  if (total == 0) return;
  const int c = clamp_ctas(ctas, total / 4 + 1, kLandThreads);
  const LandKernel k = land_kernel_for(max_src, a.accumulate != 0);
  const int grid = grid_for(reinterpret_cast<const void*>(k.fn), kLandThreads, c, total,
                            static_cast<int64_t>(k.ku) * kLandThreads * 4);
  k.fn<<<grid, kLandThreads, 0, stream>>>(a, total, cta_split_for(grid));
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching LAND");
}

void launch_cast(uint16_t* dst, const float* src, int64_t n, int ctas, cudaStream_t stream) {
  if (n == 0) return;
  const int vec = (reinterpret_cast<uintptr_t>(dst) & 7) == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  cast_kernel<<<clamp_ctas(ctas, n / 4 + 1, kCastThreads), kCastThreads, 0, stream>>>(dst, src, n, vec);
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

}  // namespace tide::cuda
