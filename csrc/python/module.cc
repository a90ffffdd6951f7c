// tide._core: the framework-neutral binding of TIDE's C++ core (raw pointers + streams only).
// Each family binds itself in its own file; this file only wires them together.
#include <nanobind/nanobind.h>

#include "tide/errors.h"

namespace nb = nanobind;

void bind_plan(nb::module_& m);     // bind_plan.cc
void bind_program(nb::module_& m);  // bind_program.cc
void bind_exec(nb::module_& m);     // bind_exec.cc
void bind_cuda(nb::module_& m);     // bind_cuda.cc
void bind_rs(nb::module_& m);       // bind_rs.cc
void bind_ag(nb::module_& m);       // bind_ag.cc
void bind_rank_exec(nb::module_& m); // bind_rank_exec.cc
void bind_session(nb::module_& m);   // bind_session.cc

NB_MODULE(_core, m) {
  m.doc() = "TIDE core: planner, programs, executors";
  // nanobind tries the most recently registered translator first, so the base tide::Error is
  // registered before its subclasses (otherwise every PlanError would surface as tide.Error).
  static nb::exception<tide::Error> tide_error(m, "Error", PyExc_RuntimeError);
  // tide.PlanError is a ValueError: bad input or an unsupported group, found before data moves.
  static nb::exception<tide::PlanError> plan_error(m, "PlanError", PyExc_ValueError);
  // tide.TimeoutError: a wait passed its deadline (fail-stop); the message names rank/op/seq.
  static nb::exception<tide::TimeoutError> timeout_error(m, "TimeoutError", PyExc_TimeoutError);
  // tide::Interrupted: the KeyboardInterrupt that PyErr_CheckSignals set while the call waited
  // (bind_common.h interrupt_check) propagates as itself.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const tide::Interrupted& e) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
    }
  });
#ifdef TIDE_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  bind_plan(m);
  bind_program(m);
  bind_exec(m);
  bind_rs(m);
  bind_ag(m);
  bind_rank_exec(m);
  bind_session(m);  // CallExecutor, before the CUDA executors that derive from it
  bind_cuda(m);     // the submodules tide._core.cuda and tide._core.testing
}
