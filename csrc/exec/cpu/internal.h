// Internal to csrc/exec/cpu: the run-wide state kept at the start of the arena mapping.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "tide/exec_cpu.h"

namespace tide {

// Lives in the (possibly shared) mapping, so forked ranks see the abort flag and can report
// the first error to the parent. Lock-free atomics only.
// What a blocked stream waits for, published so a timeout can follow the chain of waits to
// its root (the dead, stalled or mis-programmed rank).
// A stream blocked in a two-sided rail group records counter_rank = kRailGroupBlocked,
// counter_index = the group and target = its first peer's rank (timeout messages follow it).
constexpr int32_t kRailGroupBlocked = -2;
struct BlockedWait {
  std::atomic<int32_t> valid{0};
  std::atomic<int32_t> op{-1};
  std::atomic<int32_t> counter_rank{-1};
  std::atomic<int32_t> counter_index{-1};
  std::atomic<int64_t> target{0};
  std::atomic<int64_t> seq{0};
};
constexpr int kMaxStreams = 8;

// [Note: PUT checksums] A PUT records a checksum of the bytes it delivered (per receiver and
// counter, for the first kChecksumCounters counters); a receiver's WAIT tagged ArrivalWait on
// that counter (same call) re-hashes the destination and reports corruption if the bytes
// changed in between (e.g. a stage block reused early by another transfer). Opt-in by tag,
// because a late wait after a legitimate consume-and-reuse would otherwise be flagged.
constexpr int kChecksumCounters = 64;
struct PutRecord {
  std::atomic<int64_t> seq{0};
  std::atomic<uint64_t> hash{0};
  std::atomic<int32_t> src_rank{-1};
  std::atomic<int32_t> op{-1};
  std::atomic<int32_t> call{-1};
};

struct CpuArena::Shared {
  std::atomic<int> abort{0};       // set by the first failing rank; everyone stops
  std::atomic<int> claimed{0};     // first error slot claimed
  std::atomic<int> error_kind{0};  // 1 = Error, 2 = TimeoutError
  char message[4096] = {};
  BlockedWait* blocked(int rank, int stream) {
    return reinterpret_cast<BlockedWait*>(this + 1) + rank * kMaxStreams + stream;
  }
  PutRecord* put_record(int world, int rank, int counter) {
    return reinterpret_cast<PutRecord*>(blocked(world, 0)) + rank * kChecksumCounters + counter;
  }
  static size_t bytes(int world) {
    return sizeof(Shared) + sizeof(BlockedWait) * kMaxStreams * world +
           sizeof(PutRecord) * kChecksumCounters * world;
  }
};

// Initializes the run-wide state at `mem` (Shared::bytes(world) bytes) for `world` ranks.
CpuArena::Shared* init_shared(void* mem, int world);

// [Note: arena views] What the op interpreter sees of an arena: each rank's arena base and the
// region layout (offsets from that base). CpuArena gives one view over its single mapping;
// RankExecutor builds one per call over the ranks' separately mapped segments. A region with a
// negative offset is absent (an op that touches it fails, naming it).
struct ArenaView {
  int nranks = 0;
  std::vector<uint8_t*> base;  // per rank
  ArenaSpec spec;
  CpuArena::Shared* sh = nullptr;
  int world() const { return nranks; }
  bool has(BufKind k) const { return spec.offset[static_cast<int>(k)] >= 0; }
  uint8_t* region(int rank, BufKind k) const { return base[rank] + spec.offset[static_cast<int>(k)]; }
  int64_t region_bytes(BufKind k) const { return spec.bytes[static_cast<int>(k)]; }
  std::atomic<uint64_t>* counters(int rank) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base[rank] + spec.counters_offset);
  }
  int64_t num_counters() const { return spec.counters_bytes / 8; }
  CpuArena::Shared* shared() const { return sh; }
};

// The per-rank op interpreter (interpreter.cc), shared by run_cpu and RankExecutor: steps ranks
// [lo, hi) of `per_rank` over `view` (streams round-robin, each until its head op is an
// unsatisfied wait) until they finish or the run aborts. Throws TimeoutError / Error after
// recording the first failure in view.shared(). per_rank and bindings are indexed by rank and
// hold every rank (other ranks' programs name producers in timeout messages).
void step_ranks(const ArenaView& view, const std::vector<std::vector<Call>>& per_rank,
                std::vector<RankBindings>& bindings, const CpuRunOptions& opt, int lo, int hi);
void rethrow_shared(CpuArena::Shared* sh);
// One poll of opt.interrupted: on true the call's error is claimed as Interrupted and every rank
// aborts. `interrupted` latches.
bool poll_interrupt(CpuArena::Shared* sh, const CpuRunOptions& opt, bool& interrupted);

}  // namespace tide
