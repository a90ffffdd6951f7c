// The element numerics both executors share, for host and device code alike: one definition of
// the bf16 and fp16 conversions, so the CPU executor and the CUDA kernels round the same way.
//
//   bf16 -> fp32 is exact (the bits shifted up by 16);
//   fp32 -> bf16 is round-to-nearest-even; a NaN keeps its top 16 bits with the quiet bit set.
//   fp16 -> fp32 is exact (subnormals included); a NaN keeps its payload (shifted up by 13);
//   fp32 -> fp16 is round-to-nearest-even with fp16 subnormals, overflow to +-inf, and a NaN
//   becomes the quiet NaN 0x7e00 with its sign: torch's `.to(torch.float16)` (c10::Half) bit for
//   bit. Integer arithmetic only, so no flush-to-zero mode changes a bit.
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

TIDE_HOST_DEVICE float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, NaN (payload kept)
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  // Zero or a subnormal: m * 2^-24, exact in fp32 (and a normal fp32: no flush-to-zero).
  return bits_float(sign | float_bits(static_cast<float>(m) * 5.9604644775390625e-8f));
}

TIDE_HOST_DEVICE uint16_t fp32_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                              // a normal fp16 (>= 2^-14)
    uint32_t r = a - 0x38000000u;                                      // exponent rebiased 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);                                    // round to nearest, ties to even
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: ties to the even zero
  // An fp16 subnormal: the 24-bit significand in units of 2^-24, shifted right by 14..24.
  const uint32_t s = 126u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
  uint32_t q = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

}  // namespace tide
