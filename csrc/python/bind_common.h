// Shared by the binding files: the Python-held program set.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <vector>

#include "tide/exec_cpu.h"
#include "tide/program.h"

namespace tide {
// One Program per rank, shared by Python objects so Call pointers stay valid during a run.
// enable_shared_from_this: every conversion from Python yields the same control block, so the
// CUDA rank executor can key its per-set cache on the set's identity (weak_ptr).
// A generated set ([Note: generated programs]) holds headers and the generator `gen`.
struct ProgramSet : std::enable_shared_from_this<ProgramSet> {
  std::vector<Program> progs;
  bool arena_bound = false;  // built with arena=: progs' arena specs are the caller's layout
  std::shared_ptr<const ProgramGen> gen;
  // Bumped by every in-place mutation after construction (inject_fault): executors that cache
  // per-set tables key them on (identity, version) instead of rehashing the ops per call.
  uint64_t version = 0;
  // Rank r's program with its ops (a generated set emits them: a copy).
  Program program(int r) const;
  // Throws PlanError naming `what` when the set is generated (it needs built ops).
  void require_built(const char* what) const;
};
// {name: (offset, nbytes)} -> RegionTable (bind_rank_exec.cc).
RegionTable regions_from_python(const nanobind::handle& regions);
// [[(ProgramSet, seq), ...] per rank] -> per-rank calls (pointers into the sets).
std::vector<std::vector<Call>> calls_from_python(const nanobind::list& per_rank);
}  // namespace tide
