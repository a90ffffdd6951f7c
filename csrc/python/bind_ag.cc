// Bindings for the TIDE-AG schedule and AG programs (owner: TIDE-AG). Placeholder.
#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_ag(nb::module_& m) {}
