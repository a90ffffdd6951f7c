// User-buffer bindings: what a call binds to the user buffers of program.h (shard[p], landing,
// grad[p], out) on one rank. The one per-rank binding type every executor takes.
//
// Contract
//   - A face hands a session one RankBindingList per local rank (kind, index, pointer, bytes; host
//     memory on the CPU, device pointers on CUDA). The session converts it once, with
//     to_rank_bindings(), into RankBindings, which is what CallExecutor::run and every executor
//     below it (the CPU virtual cluster and RankExecutor, CudaExecutor and CudaRankExecutor) take.
//   - RankBindings stores buffer (kind, index) at by_kind[kind][index + 1]; index -1 is the whole
//     buffer (the group landing, the output shard: `out` is always stored at index -1). bytes is
//     the bound size, which executors check every access (CPU) or the program's extent (CUDA)
//     against. Only user buffers bind (arena regions are the executor's): PlanError otherwise.
#pragma once

#include <cstdint>
#include <vector>

#include "tide/program.h"

namespace tide {

// One user buffer of one rank for one call, as a face names it.
struct Binding {
  BufKind kind = BufKind::kShard;
  int32_t index = -1;  // param p (-1: the whole buffer, e.g. out)
  void* data = nullptr;
  int64_t bytes = 0;
};
using RankBindingList = std::vector<Binding>;

struct UserBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
};
// A rank's user buffers for a call: by_kind[kind][index + 1] (index -1 -> slot 0).
struct RankBindings {
  std::vector<UserBuffer> by_kind[4];
  void bind(BufKind kind, int index, void* data, int64_t bytes);
  // The buffer bound as (kind, index), or null when none is (out: index is ignored, always -1).
  const UserBuffer* find(BufKind kind, int index) const;
};

// The list's buffers as RankBindings (PlanError naming a region or a negative size).
RankBindings to_rank_bindings(const RankBindingList& l);

}  // namespace tide
