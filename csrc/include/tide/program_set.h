// A program set: one Program per rank of a group, as every executor and the checker take it.
//
// Contract
//   - Built once per (plan, call options) and shared (shared_ptr): executors that cache per-set
//     tables (the CUDA executors' run tables, any executor's program index) key them on the set's
//     identity and `version`, which every in-place mutation after construction (fault injection)
//     must bump.
//   - index(): the set's ProgramIndex (tide/program_index.h), built on first use and rebuilt after
//     a version bump; generated sets ([Note: generated programs] in program.h) have none.
//   - arena_bound: the programs' arena specs are the caller's shared layout (built with arena=),
//     not the plan's own layout.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "tide/program.h"
#include "tide/program_index.h"

namespace tide {

struct ProgramSet : std::enable_shared_from_this<ProgramSet> {
  std::vector<Program> progs;
  bool arena_bound = false;
  std::shared_ptr<const ProgramGenerator> generator;  // set: progs are headers ([Note: generated programs])
  uint64_t version = 0;

  ProgramSet() = default;
  ProgramSet(const ProgramSet& o);  // a copy shares nothing cached
  ProgramSet& operator=(const ProgramSet&) = delete;

  // Rank r's program with its ops (a generated set emits them: a copy).
  Program program(int r) const;
  // Throws PlanError naming `what` when the set is generated (it needs built ops).
  void require_built(const char* what) const;
  // The set's index (require_built first); thread-safe.
  std::shared_ptr<const ProgramIndex> index() const;

 private:
  mutable std::mutex mu_;
  mutable std::shared_ptr<const ProgramIndex> index_;
  mutable uint64_t index_version_ = 0;
};

}  // namespace tide
