// The CUDA in-process executor's staging race canary: defence in depth behind the static checker
// for the RS Level-1 staging slots (paper §4.1, invariant I3), ExecutorOptions::staging_canary.
// The CPU executor's canary (exec/cpu/staging_canary.h) checks the same two races byte by byte;
// this one checks them per (owner, slot, pusher) with tag words the GPU itself reads and writes.
//
// Contract
//   - A tag names one Level-1 unit of one call: (call ordinal << 20) | (unit + 1), where the
//     ordinal counts this executor's run() calls (monotone across program sets and banks) and the
//     unit is the op's round (builder_rs.cc: Op::round of a push COPY and of its SUMs).
//   - Words, in mapped pinned host memory every device of the fabric reaches:
//       pushed[owner][slot][pusher] = (tag << 8) | k   after the pusher's k-th push op of that unit
//       read[owner][slot]           = tag              after the owner's last SUM of that unit
//   - Before a push op into (owner, slot): the unit this pusher last wrote there must be this
//     one or already read, else "early staging reuse". Before a SUM: each pusher of its unit
//     must have completed all its push ops, else "missing push fence". A one-thread kernel on the
//     op's own stream checks (before) and marks (after), so the check sees exactly what the
//     stream order guarantees: a mark is written only after the copies or the SUM completed.
//   - The first race is recorded on the GPU; fault() (after the streams synchronised) turns it
//     into a message naming the op (rank, op index, kind, tag, round), call seq, owner, slot and
//     pusher, with "(staging-canary)". Correct programs never trigger it, whatever the timing.
//   - Ranks of several processes (CudaRankExecutor) have none: their pushes land in another
//     process's staging; the checker is their line.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tide/program.h"

namespace tide::cuda {

constexpr int kCanarySlots = 16;  // Options.n_stg's ceiling (staging slot = unit mod n_stg)

struct CanaryRecord;  // staging_canary.cu

// What one program set's ops check and mark (host, built once per set at registration).
struct CanaryPlan {
  struct Item {
    int8_t kind = 0;     // staging_canary.cu's ItemKind
    int16_t owner = 0, slot = 0, pusher = 0;
    int32_t unit = 0;
    int32_t count = 0;   // push mark: k; SUM check: the pusher's push ops of the unit
  };
  struct OpItems {
    int32_t check_id = 0;  // index of the op's description in StagingCanary
    std::vector<Item> before, after;
  };
  std::vector<std::map<int, OpItems>> ops;  // [rank] op index -> items
};

class StagingCanary {
 public:
  explicit StagingCanary(int world);
  ~StagingCanary();
  StagingCanary(const StagingCanary&) = delete;
  StagingCanary& operator=(const StagingCanary&) = delete;

  // PlanError when a slot or unit does not fit the tag words.
  std::unique_ptr<CanaryPlan> plan(const std::vector<Program>& programs);
  uint64_t begin_call(int64_t seq);  // the call's ordinal
  // Enqueue op (rank, op)'s checks / marks on `stream` (nothing when the op has none).
  void before(const CanaryPlan& p, int rank, int op, uint64_t call, cudaStream_t stream) {
    enqueue(p, rank, op, call, stream, false);
  }
  void after(const CanaryPlan& p, int rank, int op, uint64_t call, cudaStream_t stream) {
    enqueue(p, rank, op, call, stream, true);
  }
  // "" or the first race recorded, as a message; call after the streams synchronised.
  std::string fault() const;

 private:
  void enqueue(const CanaryPlan& p, int rank, int op, uint64_t call, cudaStream_t stream, bool after);
  void launch(const std::vector<CanaryPlan::Item>& items, int32_t check_id, uint64_t call, cudaStream_t stream);
  std::string tag_name(uint64_t tag) const;
  int world_;
  uint64_t* pushed_ = nullptr;  // [owner][slot][pusher]
  uint64_t* read_ = nullptr;    // [owner][slot]
  CanaryRecord* record_ = nullptr;
  void* host_ = nullptr;        // the one mapped pinned allocation
  std::vector<std::string> ops_;   // check_id -> "rank R op I (KIND, tag T, round U)"
  std::vector<int64_t> seq_of_;    // ordinal - 1 -> the call's seq
};

}  // namespace tide::cuda
