// Device helpers shared by the CUDA kernels (kernels.cu, reduce.cu, bulk.cu). Include from .cu
// files only.
#pragma once

#include <cstdint>

namespace tide::cuda::device {

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 word.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// [Note: CTA work split]
// SUM, LAND and REDUCE split their element space [0, n) over the grid in one of two ways, picked
// per launch by TIDE_CTA_SPLIT (kernels.h: cta_split_for(); default auto: tiles from 32 CTAs):
//   - tiles: CTA c takes tiles c, c + G, c + 2G, ... of one loop iteration's size, so
//     the grid sweeps each operand front to back together: a handful of DRAM streams, as a
//     copy kernel has. A full grid of contiguous ranges opens (operands x CTAs) streams far apart
//     (1188 for SUM at L = 8 on 132 SMs), which measured ~1.25-1.4x a copy's time per byte.
//   - ranges: CTA c takes one contiguous range of ~n/G elements. A few CTAs are latency-bound
//     and open few streams anyway; their long ranges keep ~10 % more per CTA than tiles.
// LAND in tiles also prefetches each CTA's next tile into L2 (tried and dropped: running a budget
// of c CTAs as 2c half-size CTAs, two per SM: no faster, BENCHMARKS.md Run 23).
// Either way there is no persistence and no inter-CTA communication: a CTA walks its own pieces
// and exits, so the CTA budget stays an exact upper bound on the SMs a launch occupies (paper
// §2.2: short-lived CTAs); a budget of a whole resident wave in tiles runs one CTA per tile
// (kernels.h [Note: full grid]). Tile starts are multiples of `tile`, range starts of kRangeAlign
// elements (a multiple of every kernel's `align`): 512 B of bf16, 1 KiB of fp32, so a warp's
// 512-byte vector load covers 4 whole 128-byte lines, not 5. Ranges of n / G elements start
// mid-line whenever G is not a power of two, and a SUM launch of 6, 10, 12, 14 or 24 CTAs then ran
// at 84 GB/s per CTA against 104 at 4, 8 and 16 (BENCHMARKS.md Run 27).
constexpr int64_t kRangeAlign = 256;
template <class F>
__device__ __forceinline__ void for_each_piece(int64_t n, int64_t align, int64_t tile, bool ranges, F&& f) {
  if (ranges) {
    int64_t per = (n + gridDim.x - 1) / gridDim.x;
    per = (per + kRangeAlign - 1) / kRangeAlign * kRangeAlign;  // kRangeAlign % align == 0
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * per;
    const int64_t end = begin + per < n ? begin + per : n;
    if (begin < end) f(begin, end);
    return;
  }
  for (int64_t t = blockIdx.x; t * tile < n; t += gridDim.x) {
    const int64_t end = (t + 1) * tile < n ? (t + 1) * tile : n;
    f(t * tile, end);
  }
}

// [Note: L2 bulk prefetch]
// Register-staged loads cap a CTA at ~128 KiB in flight (the register file), ~97 GB/s per CTA at
// HBM latency. One thread per operand asks the bulk-copy engine to prefetch the chunk `dist`
// iterations ahead into L2 (cp.async.bulk.prefetch.L2, sm_90; no registers, no shared memory, no
// completion to wait for). The distance shrinks with the grid so the prefetched working set stays
// well inside the 60 MB L2. Measured on the H200 (BENCHMARKS.md Run 4) it made SUM slower
// (98 -> 79 GB/s per CTA), so SUM and REDUCE issue it only as the opt-in `vec_l2` variant
// (TIDE_SUM_KERNEL, kernels.h); LAND keeps it.
__device__ __forceinline__ void l2_prefetch(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  bytes &= ~int64_t(15);
  if (bytes <= 0 || (reinterpret_cast<uintptr_t>(p) & 15) != 0) return;  // the bulk op needs 16 B alignment
  if (bytes > (int64_t(1) << 20)) bytes = int64_t(1) << 20;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(static_cast<uint32_t>(bytes))
               : "memory");
#endif
}
__device__ __forceinline__ int prefetch_dist() { return gridDim.x <= 16 ? 4 : (gridDim.x <= 48 ? 2 : 1); }

// ---- sm_90 bulk copies and shared-memory barriers (the `bulk` SUM variant, bulk.cu) ----------
// Host code launches kernels that use these only on compute capability >= 9.0; an older target
// traps instead of silently computing nothing.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void sm90_only() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
  __trap();
#endif
}

// mbarrier with `count` expected arrivals per phase; phase 0 starts incomplete.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#else
  sm90_only();
#endif
}

// Makes the initialised barriers visible to the async proxy (bulk-copy completions); follow
// with a CTA barrier before any thread uses them.
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival that also raises the phase's expected transaction bytes by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#else
  sm90_only();
#endif
}

// One plain arrival (release: this thread's earlier shared-memory reads are ordered before it).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#else
  sm90_only();
#endif
}

// Blocks until the phase with parity `parity` has completed (acquire). On a fresh barrier,
// parity 1 names the phase before phase 0 and returns at once (the producer's first pass).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t a = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
#else
  sm90_only();
#endif
}

// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
// (bulk copy) accesses to the same memory, once combined with the mbarrier release/acquire that
// hands a ring stage back to the producer (bulk.cu, consumer release).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
  sm90_only();
#endif
}

// 1-D bulk copy global -> shared (TMA); completes `bytes` transaction bytes on `bar`.
// dst and src 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst_smem)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#else
  sm90_only();
#endif
}

}  // namespace tide::cuda::device
