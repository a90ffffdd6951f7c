// Shared by the binding files: conversions between Python objects and the core's types.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <vector>

#include "tide/exec_cpu.h"
#include "tide/program.h"
#include "tide/program_set.h"
#include "tide/session.h"

namespace tide {
// {name: (offset, nbytes)} -> RegionTable.
RegionTable regions_from_python(const nanobind::handle& regions);
// [[(ProgramSet, seq), ...] per rank] -> per-rank calls (pointers into the sets).
std::vector<std::vector<Call>> calls_from_python(const nanobind::list& per_rank);
// [(buf_kind, index, data_ptr, nbytes), ...] -> one rank's binding list; `who` names the caller.
RankBindingList bindings_from_python(const nanobind::handle& items, const char* who);
// {field: value} (tide.ExecutorOptions' fields; None: the defaults) -> validated options.
ExecutorOptions options_from_python(const nanobind::handle& opts);
// The same with the `timeout_s=` shorthand of the executors' constructors (None: options' own).
ExecutorOptions options_from_python(const nanobind::handle& opts, const nanobind::handle& timeout_s);
// CpuRunOptions.interrupted for a call made with the GIL released: takes the GIL and runs
// Python's pending signal handlers; true when one raised (Ctrl-C: KeyboardInterrupt, left set
// for the Interrupted translator in module.cc).
inline std::function<bool()> python_interrupt_check() {
  return [] {
    nanobind::gil_scoped_acquire gil;
    return PyErr_CheckSignals() != 0;
  };
}
}  // namespace tide
