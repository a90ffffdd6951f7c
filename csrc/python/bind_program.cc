// Bindings for csrc/program (owner: programs). Placeholder.
#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_program(nb::module_& m) {}
