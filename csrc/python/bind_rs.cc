// Bindings for the TIDE-RS schedule, validator and RS programs (owner: TIDE-RS). Placeholder.
#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_rs(nb::module_& m) {}
