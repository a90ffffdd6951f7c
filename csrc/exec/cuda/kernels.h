// TIDE CUDA kernels: SUM, LAND, CAST, ZERO (paper §4.1, §4.2, §3.1).
//
// Contract
//   - Every launch takes an explicit stream and a CTA budget (`ctas`); kernels never poll peers,
//     never spin, and each CTA retires as soon as its share of the elements is written.
//   - Arguments travel as kernel parameters (a few KiB): no per-call metadata copy to the GPU.
//     The only device-resident table is SUM's segment table, uploaded once at registration.
//   - Arithmetic is fp32 with explicit round-to-nearest adds/multiplies (__fadd_rn/__fmul_rn),
//     so no FMA contraction changes bits. The association is fixed and documented per kernel;
//     the CPU executor uses the same one, so both produce the same bytes.
//   - bf16 is handled as raw uint16 bits: bf16 -> fp32 is exact (bits << 16); fp32 -> bf16 is
//     round-to-nearest-even with NaN -> 0x7FC0 | sign (ml_dtypes' convention).
//   - All launches are graph-capturable and allocation-free. Host wrappers check the launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tide::cuda {

constexpr int kMaxStaged = 7;       // L - 1 staged slices, L <= 8
constexpr int kMaxGradPtrs = 256;   // P <= 256 parameters per group
constexpr int kMaxLandSrcs = 8;     // L inbox blocks per wave
constexpr int kMaxLandJobs = 16;    // landing jobs (sub-slices) per launch
constexpr int kMaxZeroRegions = 32; // stale blocks per launch
constexpr int kSumThreads = 512;
constexpr int kLandThreads = 512;
constexpr int kCastThreads = 256;
constexpr int kZeroThreads = 256;

// ---- SUM: fp32 node partial (Level 1) ------------------------------------------------------
// dst[k] = ((stg_0[k] + stg_1[k]) + ... + stg_{n_staged-1}[k]) + own[k]   (fp32, left to right)
// where own[k] comes from the segment covering k: grad[param][src_off + (k - dst_off)] (bf16)
// or 0.0f where param < 0 (padding rows past D_p). With n_staged == 0, dst[k] = (float)own[k].
// Segments are sorted by dst_off, disjoint, and cover [0, n) exactly.
struct SumSegment {
  int64_t dst_off;  // first element in dst
  int64_t len;      // elements
  int64_t src_off;  // first element in grad[param]
  int32_t param;    // index into SumArgs::grad; < 0: own contribution is zero
  int32_t pad_;
};

struct SumArgs {
  float* dst = nullptr;
  int64_t n = 0;                                   // elements of dst
  const uint16_t* staged[kMaxStaged] = {};         // bf16 slices, same indexing as dst
  int n_staged = 0;                                // 0 .. L-1, in local-rank order
  int n_segs = 0;
  const SumSegment* segs = nullptr;                // device table (uploaded at registration)
  const uint16_t* grad[kMaxGradPtrs] = {};         // per-parameter bf16 gradient base pointers
};

// ---- LAND: inbox blocks -> fp32 output (Level 2) --------------------------------------------
// For each job: t = ((src_0[k] + src_1[k]) + ... + src_{n_src-1}[k]);  v = alpha * t;
//               dst[k] = accumulate ? dst[k] + v : v.
struct LandJob {
  float* dst = nullptr;
  const float* src[kMaxLandSrcs] = {};
  int n_src = 0;
  int64_t n = 0;
};
struct LandArgs {
  LandJob jobs[kMaxLandJobs];
  int n_jobs = 0;
  float alpha = 1.0f;
  int accumulate = 0;
};

// ---- ZERO: stale inbox blocks -----------------------------------------------------------------
struct ZeroRegion {
  void* ptr = nullptr;
  int64_t bytes = 0;
};
struct ZeroArgs {
  ZeroRegion regions[kMaxZeroRegions];
  int n_regions = 0;
};

void launch_sum(const SumArgs& a, int ctas, cudaStream_t stream);
void launch_land(const LandArgs& a, int ctas, cudaStream_t stream);
void launch_cast(uint16_t* dst, const float* src, int64_t n, int ctas, cudaStream_t stream);
void launch_zero(const ZeroArgs& a, int ctas, cudaStream_t stream);

// Host reference of the bf16 rounding the CAST kernel uses (for tests and the CPU side).
uint16_t float_to_bf16_rne(float f);

}  // namespace tide::cuda
