// The element numerics both executors share, for host and device code alike: one definition of
// the bf16 conversions, so the CPU executor and the CUDA kernels round the same way.
//
//   bf16 -> fp32 is exact (the bits shifted up by 16);
//   fp32 -> bf16 is round-to-nearest-even; a NaN keeps its top 16 bits with the quiet bit set.
// Sums and scales are fp32 with explicit round-to-nearest operations in a fixed association
// (exec/cuda/kernels.h, exec_cpu.h), never fused.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TIDE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TIDE_HOST_DEVICE inline
#endif

namespace tide {

TIDE_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

TIDE_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

TIDE_HOST_DEVICE uint16_t fp32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

TIDE_HOST_DEVICE float bf16_to_fp32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

}  // namespace tide
