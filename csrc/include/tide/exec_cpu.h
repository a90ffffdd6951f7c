// CPU executor: runs TIDE programs on a virtual cluster over shared memory.
//
// Contract
//   - CpuArena owns one symmetric arena per rank (ArenaSpec::total bytes each, followed by a
//     canary guard) in ONE mapping: process-private memory for ranks-as-threads, or a POSIX
//     shared-memory segment (mode 0600, unlinked right after mapping, so nothing outlives the
//     process even on failure) for ranks-as-processes. Counters live in each arena's "counters"
//     region as lock-free 64-bit atomics, so they work across processes; they persist across
//     calls (epochs, never reset).
//   - run_cpu() executes per-rank call lists. Threads mode: `workers` threads each step a fixed
//     subset of ranks. Processes mode: forked children (one per rank up to 64, else subsets) step
//     their ranks and exit with _exit(); user buffers the program writes are bounced through
//     shared memory and copied back. Inside a rank the streams run in a deterministic
//     round-robin interleaving: a stream advances until its head op is an unsatisfied wait.
//   - A wait that passes `timeout_s` throws tide::TimeoutError naming rank, op index and kind,
//     stream, tag, call seq, the counter and its producer. The first failure aborts every rank.
//     After a run the canaries are verified (tide::Error names the rank and region on damage);
//     a PUT's bytes are checksummed and re-verified by the receiver's ArrivalWait (corruption
//     between delivery and consumption is reported naming both ops).
//   - Bounds: every BufRef is checked against its bound user buffer / arena region; user
//     buffers of another rank are refused (the push rule).
//   - TIDE_DEBUG=1 (read by exec_options_from_env(), not cached) traces every op per rank to
//     stderr.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "tide/program.h"

namespace tide {

struct UserBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
};
// A rank's user buffers for a run: by_kind[kind][index + 1] (index -1 -> slot 0).
struct RankBindings {
  std::vector<UserBuffer> by_kind[4];
  void bind(BufKind kind, int index, void* data, int64_t bytes);
};

struct ExecOptions {
  double timeout_s = 30.0;
  bool trace = false;   // TIDE_DEBUG=1
  int workers = 0;      // threads mode: worker threads (0: min(ranks, 4))
  bool processes = false;
  bool verify_agreement = true;  // host check that ranks agree on (group, seq, plan) order first
                                 // (off in tests: a disagreement must then time out, named)
  // Fault injection (tests only): a rank pauses for stall_s once it reaches op stall_op of its
  // first call, or stops for good at op dead_op (a dead peer; in processes mode it exits).
  int stall_rank = -1;
  int64_t stall_op = 0;
  double stall_s = 0;
  int dead_rank = -1;
  int64_t dead_op = 0;
};
ExecOptions exec_options_from_env();

class CpuArena {
 public:
  CpuArena(int world, const ArenaSpec& spec, bool shared_memory);
  ~CpuArena();
  CpuArena(const CpuArena&) = delete;
  CpuArena& operator=(const CpuArena&) = delete;

  int world() const { return world_; }
  const ArenaSpec& spec() const { return spec_; }
  bool shared_memory() const { return shm_; }
  int64_t bytes_per_rank() const { return spec_.total; }  // measured arena bytes per rank
  uint8_t* region(int rank, BufKind kind) const;
  int64_t region_bytes(BufKind kind) const { return spec_.bytes[static_cast<int>(kind)]; }
  std::atomic<uint64_t>* counters(int rank) const;
  int64_t num_counters() const { return spec_.counters_bytes / 8; }
  void check_canaries() const;  // throws Error naming rank and region
  struct Shared;                // run-wide abort flag and first error (in the mapping)
  Shared* shared() const { return shared_; }

 private:
  int world_;
  ArenaSpec spec_;
  bool shm_;
  int64_t stride_ = 0;  // bytes per rank incl. guard
  int64_t shared_bytes_ = 0;
  uint8_t* base_ = nullptr;
  size_t map_bytes_ = 0;
  Shared* shared_ = nullptr;
};

// Runs per_rank[r] (rank r's calls, in order) on `arena`. bindings[r] are rank r's user
// buffers for every call of this run. Throws TimeoutError / Error (see the contract).
void run_cpu(CpuArena& arena, const std::vector<std::vector<Call>>& per_rank,
             std::vector<RankBindings>& bindings, const ExecOptions& opt);

}  // namespace tide
