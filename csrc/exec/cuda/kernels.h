// TIDE CUDA kernels: SUM, REDUCE (every other SUM and every LAND), CAST, ZERO (paper §4.1, §4.2,
// §3.1).
//
// Contract
//   - Every launch takes an explicit stream and a CTA budget (`ctas`); kernels never poll peers,
//     never spin, and each CTA retires as soon as its share of the elements is written.
//   - Arguments travel as kernel parameters (a few KiB): no per-call metadata copy to the GPU.
//     The only device-resident table is SUM's segment table, uploaded once at registration.
//   - Arithmetic is fp32 with explicit round-to-nearest adds/multiplies (__fadd_rn/__fmul_rn),
//     so no FMA contraction changes bits. The association is fixed and documented per kernel;
//     the CPU executor uses the same one, so both produce the same bytes.
//   - bf16 is handled as raw uint16 bits through tide/numerics.h, the CPU executor's conversions.
//   - Launch knobs (how a launch splits its elements, the full-grid rule) come from the
//     executor's options (tide/exec_options.h) as LaunchKnobs; nothing here reads the environment.
//   - All launches are graph-capturable and allocation-free. Host wrappers check the launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tide/exec_options.h"

namespace tide::cuda {

constexpr int kMaxStaged = 7;       // L - 1 staged slices, L <= 8
constexpr int kMaxGradPtrs = 256;   // P <= 256 parameters per group
constexpr int kMaxZeroRegions = 32; // stale blocks per launch
constexpr int kSumThreads = 256;   // with sum_unroll() vectors per thread (kernels.cu)
constexpr int kCastThreads = 256;
constexpr int kZeroThreads = 256;
constexpr int kMaxSmCopies = 48;    // copies per COPY-on-SMs launch
constexpr int kCopyThreads = 512;

// ---- SUM: fp32 node partial (Level 1) ------------------------------------------------------
// dst[k] = ((stg_0[k] + stg_1[k]) + ... + stg_{n_staged-1}[k]) + own[k]   (fp32, left to right)
// where own[k] comes from the segment covering k: grad[param][src_off + (k - dst_off)] (bf16,
// or fp16 with SumArgs::fp16: staged slices and gradients are one 16-bit dtype, widened exactly);
// where param < 0 (padding rows past D_p) the own term is absent and not added. With
// n_staged == 0, dst[k] = own[k] (or 0.0f where absent). Same association as REDUCE below.
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
  const uint16_t* staged[kMaxStaged] = {};         // bf16 (fp16) slices, same indexing as dst
  int n_staged = 0;                                // 0 .. L-1, in local-rank order
  int n_segs = 0;
  const SumSegment* segs = nullptr;                // device table (uploaded at registration)
  const uint16_t* grad[kMaxGradPtrs] = {};         // per-parameter bf16 (fp16) gradient base pointers
  int fp16 = 0;                                    // 1: every operand is fp16, else bf16
  // A direct Level-1 SUM into the output ([Note: direct Level 1], plan.h) folds alpha and
  // accumulate in as LAND does: v = alpha * t (only when scale), dst = accumulate ? dst + v : v.
  int scale = 0;
  int accumulate = 0;
  float alpha = 1.0f;
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

// ---- COPY on SMs (exec/cuda/runtime.h [Note: copies on SMs]) --------------------------------
// Each copy moves `height` rows of `width` bytes in units of `vec` bytes (16, 8, 4, 2 or 1: the
// largest that divides both pointers, the width and, for 2-D copies, both pitches). Copies of
// one launch are disjoint and unordered; bytes are moved, never interpreted.
struct SmCopy {
  char* dst = nullptr;
  const char* src = nullptr;
  int64_t width = 0;
  int64_t height = 0;
  int64_t dpitch = 0;
  int64_t spitch = 0;
  int32_t vec = 1;
  int32_t pad_ = 0;
};
struct SmCopyArgs {
  SmCopy copies[kMaxSmCopies];
  int n = 0;
};

// ---- REDUCE: the executor's generic SUM/LAND over program terms (reduce.cu) -----------------
// The program's terms are cut, once at registration, into runs: maximal element intervals in
// which every term is either one contiguous source or absent (zero). A run names each source as
// (slot, byte offset); slots are resolved per call from ReduceArgs::base, so the run table is
// call-invariant and uploaded once. For every element k of a run:
//   t = x_first; for each later present term i in order: t = t + x_i   (absent terms are
//   skipped; an element no term covers is 0.0f)
//   SUM : dst[k] = t
//   LAND: v = alpha * t; dst[k] = accumulate ? dst[k] + v : v
// (fp32, explicit round-to-nearest; this is the CPU executor's association.)
constexpr int kMaxTerms = 12;
constexpr int kMaxSlots = 384;  // user grad[p] 0..255, out 256, arena of rank r at 257 + r
constexpr int kSlotOut = 256;
constexpr int kSlotArena0 = 257;
struct ReduceRun {
  int64_t dst_off;             // first element (relative to ReduceArgs::dst)
  int64_t len;                 // elements
  int64_t off[kMaxTerms];      // byte offset from the slot base
  int16_t slot[kMaxTerms];     // < 0: term absent in this run
  int16_t pad_[4];
};
static_assert(sizeof(ReduceRun) == 144, "ReduceRun: cuda_reduce's callers pack 144-byte records");
struct ReduceArgs {
  float* dst = nullptr;
  const ReduceRun* runs = nullptr;  // device table
  int n_runs = 0;
  int n_terms = 0;
  uint32_t fp32_terms = 0;          // bit i: term i is fp32
  uint32_t fp16_terms = 0;          // bit i: term i is fp16 (a term in neither mask is bf16)
  int land = 0;                     // 0: SUM, 1: LAND
  int accumulate = 0;
  float alpha = 1.0f;
  int64_t n = 0;                    // elements covered by the runs (sum of len)
  const void* base[kMaxSlots] = {};
};
// The executor's options as a launch sees them.
struct LaunchKnobs {
  CtaSplit split = CtaSplit::kAuto;
  FullGrid full_grid = FullGrid::kTiles;
};
inline LaunchKnobs launch_knobs(const ExecutorOptions& o) { return {o.cta_split, o.full_grid}; }
void launch_reduce(const ReduceArgs& a, int ctas, const LaunchKnobs& knobs, cudaStream_t stream);

// ---- CTA work split of SUM and REDUCE --------------------------------------------------------
// device.cuh [Note: CTA work split]: CtaSplit::kAuto (tiles from kTilesMinCtas CTAs, ranges
// below), kTiles or kRanges; same bits either way.
constexpr int kSplitTiles = 0;   // what a launch runs (the kernels' `split` argument)
constexpr int kSplitRanges = 1;
constexpr int kTilesMinCtas = 32;
int split_for(int ctas, const LaunchKnobs& k);  // kSplitTiles or kSplitRanges for `ctas` CTAs

// [Note: full grid]
// A budget of at least one resident wave (SMs x resident CTAs per SM of the kernel) already
// allows every SM; such a launch in tiles runs one short-lived CTA per tile instead of one wave
// of CTAs that each loop over tiles, so the hardware block scheduler balances the tiles over the
// SMs as they free up (as an elementwise torch kernel does). Measured on the H200 (BENCHMARKS.md,
// full grid): the 70B LAND at 132 CTAs 1.25x its floor, one CTA per tile 1.10x; torch's scale of the
// same bytes 1.07x. Smaller budgets and ranges launch exactly `ctas` CTAs. FullGrid::kWave (an
// executor option) launches one wave, the budget as given; same bits either way.
// The grid a launch of `kernel` (`threads` per CTA) with budget `ctas` over `n` elements in
// tiles of `tile` elements runs; `ctas` itself unless the note above applies.
int grid_for(const void* kernel, int threads, int ctas, int64_t n, int64_t tile, const LaunchKnobs& k);

// Registers and local memory (spills + stack) of every SUM/REDUCE kernel instantiation, as the
// driver reports them for the current device (cudaFuncGetAttributes).
struct KernelAttrs {
  std::string name;
  int regs = 0;
  int local_bytes = 0;
  int static_smem = 0;
  int max_threads = 0;
};
std::vector<KernelAttrs> sum_kernel_attrs();
// [Note: eager kernel loading]
// Under CUDA's lazy module loading (the default, and torch's), a kernel's first launch loads its
// code. Rank 0 of tests/test_cuda_ipc.py's dead-peer case hung, about one run in six, inside
// cuLaunchKernel at the first REDUCE launch of its first reduce-scatter, while one of its streams
// was parked on an entry-fence WAIT and its watchdog sat idle (BENCHMARKS.md, the IPC hang). Our reading:
// the load waits for the device, and the watchdog's release write queues behind that same wait.
// Every executor therefore loads all of our kernels on its devices when it is created, before any
// WAIT exists; the hang has not recurred since (BENCHMARKS.md).
void preload_kernels(int device);
void append_reduce_kernel_attrs(std::vector<KernelAttrs>* out);  // reduce.cu

// CTAs of the SUM kernel (L-1 = n_staged) or of REDUCE ("reduce" / "reduce_fp32": n_staged = its
// bf16 / fp32 terms) resident on one SM at once: SMs x this is a grid that fills the device in
// one wave.
int resident_ctas_per_sm(const std::string& kernel, int n_staged = 0);
int reduce_resident_ctas_per_sm(int n_terms, bool fp32);  // reduce.cu
// The occupancy API for one kernel of ours on the current device (return code checked).
int resident_per_sm(const void* kernel, int threads);
void launch_sum(const SumArgs& a, int ctas, const LaunchKnobs& knobs, cudaStream_t stream);
// CAST fp32 -> bf16 (or fp16 with `fp16`), round-to-nearest-even (tide/numerics.h).
void launch_cast(uint16_t* dst, const float* src, int64_t n, int ctas, cudaStream_t stream, bool fp16 = false);
void launch_zero(const ZeroArgs& a, int ctas, cudaStream_t stream);
// The widest unit (16, 8, 4, 2, 1 bytes) a copy of these pointers, width and pitches can move.
int sm_copy_vec(const void* dst, const void* src, int64_t width, int64_t height, int64_t dpitch, int64_t spitch);
void launch_sm_copies(const SmCopyArgs& a, int ctas, cudaStream_t stream);


}  // namespace tide::cuda
