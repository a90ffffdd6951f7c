// Device helpers shared by the CUDA kernels (kernels.cu, reduce.cu). Include from .cu files only.
#pragma once

#include <cstdint>

namespace tide::cuda::device {

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 word.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// [Note: L2 bulk prefetch]
// Register-staged loads cap a CTA at ~128 KiB in flight (the register file), ~97 GB/s per CTA at
// HBM latency. One thread per operand asks the bulk-copy engine to prefetch the chunk `dist`
// iterations ahead into L2 (cp.async.bulk.prefetch.L2, sm_90; no registers, no shared memory, no
// completion to wait for). The distance shrinks with the grid so the prefetched working set stays
// well inside the 60 MB L2. Measured on the H200 (BENCHMARKS.md Run 4) it did not pay for SUM.
__device__ __forceinline__ void l2_prefetch(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  bytes &= ~int64_t(15);
  if (bytes <= 0) return;
  if (bytes > (int64_t(1) << 20)) bytes = int64_t(1) << 20;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(static_cast<uint32_t>(bytes))
               : "memory");
#endif
}
__device__ __forceinline__ int prefetch_dist() { return gridDim.x <= 16 ? 4 : (gridDim.x <= 48 ? 2 : 1); }

}  // namespace tide::cuda::device
