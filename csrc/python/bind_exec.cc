// Bindings for csrc/exec/cpu (owner: programs/CPU executor). Placeholder.
#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_exec(nb::module_& m) {}
