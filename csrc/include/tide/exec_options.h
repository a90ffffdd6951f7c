// Executor options: every knob of TIDE's executors, set once when an executor is created.
//
// Contract
//   - One struct for every executor (CPU virtual cluster, CPU rank executor, CUDA executors);
//     a field an executor does not use is ignored by it. validate() throws PlanError naming the
//     field and its range; every executor validates its options when it is created.
//   - CTA budgets are not here: SUM and LAND budgets travel with the programs (Program::sum_ctas /
//     land_ctas, from the plan's solver, Eqs. 13-14, or a session's explicit override).
//   - Executor options read the environment in ONE place, with_debug_env(), once per executor
//     creation, and only for debug overrides: TIDE_DEBUG=1 turns on `trace`;
//     TIDE_EXEC_OPTIONS="field=value,..." overrides any field by name (e.g.
//     "cta_split=ranges,copy_lanes=1"). A garbage value is a PlanError naming the variable and the
//     field. The core reads exactly two other groups of variables, process-wide switches that are
//     not executor options, each in one function, once per process: the multicast gate
//     (TIDE_ENABLE_MULTICAST, NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST; gate_env() in
//     exec/cuda/runtime.cc) and the NCCL library override (TIDE_NCCL_LIBRARY; open_library() in
//     fabric/nccl.cc, at NCCL's first load). Nothing else in csrc/ or ffi/ calls getenv.
#pragma once

#include <cstdint>
#include <string>

#include "tide/program.h"  // Rails (the program IR's mark)

namespace tide {

// How a SUM/LAND/REDUCE launch splits its elements over its CTAs (exec/cuda/device.cuh
// [Note: CTA work split]): auto = tiles from 32 CTAs on, one contiguous range per CTA below.
enum class CtaSplit : int8_t { kAuto = 0, kTiles = 1, kRanges = 2 };
// A budget of at least one resident wave in tiles (exec/cuda/kernels.h [Note: full grid]): one
// short-lived CTA per tile, or the budget's CTAs looping over tiles.
enum class FullGrid : int8_t { kTiles = 0, kWave = 1 };
// Eager 2-D copies: one cudaMemcpy3DBatchAsync per op, or one cudaMemcpy2DAsync per copy.
enum class Copy2D : int8_t { kBatch = 0, kPerCopy = 1 };
// Where a COPY/PUT op's copies run (exec/cuda/runtime.h [Note: copies on SMs]): auto = on SMs when
// the op copies between two ranks that share a device (an emulated node: the ranks of a virtual
// cluster on one GPU), on the copy engines otherwise; or every copy on one of the two.
enum class CopiesOn : int8_t { kAuto = 0, kCopyEngines = 1, kSms = 2 };

struct ExecutorOptions {
  double timeout_s = 30.0;              // every wait's deadline (fail-stop), seconds, (0, 1e6]
  // CUDA executors.
  int cast_ctas = 32;                   // CAST (mixed-precision all-gather), 1..4096
  int zero_ctas = 8;                    // ZERO (stale inbox blocks), 1..4096
  CtaSplit cta_split = CtaSplit::kAuto;
  FullGrid full_grid = FullGrid::kTiles;
  int copy_lanes = 4;                   // streams a large COPY/PUT is spread over, 1..8 (1: none)
  int64_t copy_spread_bytes = 8 << 20;  // an op moving fewer bytes stays on its own stream, >= 0
  Copy2D copy_2d = Copy2D::kBatch;
  CopiesOn copies_on = CopiesOn::kAuto;
  int copy_ctas = 32;                   // CTAs of one COPY/PUT op's copies on SMs, 1..4096
  // Calls replayed as CUDA graphs ([Note: replayed calls], exec/cuda/graph.h): a call seen again
  // with the same program set and buffers is captured, then replayed with one launch.
  bool graphs = false;
  bool sync_every_call = false;         // debug: synchronise after every call
  // CUDA rank executors of several ranks of one process take turns so that the process enqueues
  // in one global order (fabric/fabric.h [Note: same-process issue gate]); off: for diagnosis.
  bool issue_gate = true;
  // Debug: the in-process executor checks every staged push and SUM against the staging races
  // (exec/cuda/staging_canary.h; two one-thread kernels per such op). The CPU executor with ranks
  // as threads always runs its own canary.
  bool staging_canary = false;
  // CPU executor.
  bool trace = false;                   // every executed op per rank to stderr
  int workers = 0;                      // virtual cluster threads, 0..1024 (0: min(ranks, 4))
  // Every executor.
  Rails rails = Rails::kOneSided;       // how other nodes are reached (Rails, tide/program.h)
  // Two-sided rails on CUDA: the NCCL rail communicator's config ([Note: NCCL rail]).
  int rail_ctas = 2;                    // maxCTAs: SMs a rail group's kernel may take, 1..64
  int rail_channels_per_peer = 1;       // nChannelsPerNetPeer, 1..32
};

void validate(const ExecutorOptions& o);  // PlanError naming the field
// timeout_s if it is a valid ExecutorOptions::timeout_s (PlanError naming the field otherwise):
// what every executor's set_timeout() checks.
double checked_timeout(double timeout_s);
// The options with the environment's debug overrides applied (see the contract).
ExecutorOptions with_debug_env(ExecutorOptions o);
// Sets field `name` from its text form (the TIDE_EXEC_OPTIONS syntax); PlanError on a bad name or
// value, naming `where`.
void set_option(ExecutorOptions& o, const std::string& name, const std::string& value, const std::string& where);
// "cta_split=auto,full_grid=tiles,..." (every field; set_option's syntax).
std::string describe(const ExecutorOptions& o);

const char* cta_split_name(CtaSplit s);  // "auto", "tiles", "ranges"
const char* full_grid_name(FullGrid g);  // "tiles", "wave"
const char* copy_2d_name(Copy2D c);      // "batch", "per_copy"
const char* copies_on_name(CopiesOn c);  // "auto", "copy_engines", "sms"

}  // namespace tide
