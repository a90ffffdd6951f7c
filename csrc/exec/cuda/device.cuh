// Device helpers shared by the CUDA kernels (kernels.cu, reduce.cu). Include from .cu files only.
#pragma once

#include <cstdint>

#include "tide/numerics.h"

namespace tide::cuda::device {

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 word.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// The low / high 16-bit item of a word as fp32, bf16 or (FP16) fp16: exact either way
// (tide/numerics.h, the CPU executor's conversion).
template <bool FP16>
__device__ __forceinline__ float half_lo(uint32_t w) {
  return FP16 ? tide::fp16_to_fp32(static_cast<uint16_t>(w & 0xffffu)) : bf16_lo(w);
}
template <bool FP16>
__device__ __forceinline__ float half_hi(uint32_t w) {
  return FP16 ? tide::fp16_to_fp32(static_cast<uint16_t>(w >> 16)) : bf16_hi(w);
}
template <bool FP16>
__device__ __forceinline__ float half_to_f32(uint16_t h) {
  return FP16 ? tide::fp16_to_fp32(h) : tide::bf16_to_fp32(h);
}

// [Note: CTA work split]
// SUM and REDUCE split their element space [0, n) over the grid in one of two ways, picked per
// launch from the executor's ExecutorOptions::cta_split (kernels.h: split_for(); default auto:
// tiles from 32 CTAs):
//   - tiles: CTA c takes tiles c, c + G, c + 2G, ... of one loop iteration's size, so
//     the grid sweeps each operand front to back together: a handful of DRAM streams, as a
//     copy kernel has. A full grid of contiguous ranges opens (operands x CTAs) streams far apart
//     (1188 for SUM at L = 8 on 132 SMs), which measured ~1.25-1.4x a copy's time per byte.
//   - ranges: CTA c takes one contiguous range of ~n/G elements. A few CTAs are latency-bound
//     and open few streams anyway; their long ranges keep ~10 % more per CTA than tiles.
// Either way there is no persistence and no inter-CTA communication: a CTA walks its own pieces
// and exits, so the CTA budget stays an exact upper bound on the SMs a launch occupies (paper
// §2.2: short-lived CTAs); a budget of a whole resident wave in tiles runs one CTA per tile
// (kernels.h [Note: full grid]). Tile starts are multiples of `tile`, range starts of kRangeAlign
// elements (a multiple of every kernel's `align`): 512 B of bf16, 1 KiB of fp32, so a warp's
// 512-byte vector load covers 4 whole 128-byte lines, not 5. Ranges of n / G elements start
// mid-line whenever G is not a power of two, and a SUM launch of 6, 10, 12, 14 or 24 CTAs then ran
// at 84 GB/s per CTA against 104 at 4, 8 and 16 (BENCHMARKS.md, CTA ranges).
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

}  // namespace tide::cuda::device
