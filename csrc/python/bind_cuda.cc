// Bindings for csrc/exec/cuda and csrc/fabric (owner: CUDA executor). Without CUDA this module
// still imports and reports cuda_available() == False.
#include <nanobind/nanobind.h>
namespace nb = nanobind;

#ifdef TIDE_WITH_CUDA
namespace tide::cuda {
int device_count();
}
#endif

void bind_cuda(nb::module_& m) {
  m.def("cuda_device_count", []() {
#ifdef TIDE_WITH_CUDA
    return tide::cuda::device_count();
#else
    return 0;
#endif
  }, "Number of usable CUDA devices (0 without a CUDA build, driver or device).");
  m.def("cuda_available", []() {
#ifdef TIDE_WITH_CUDA
    return tide::cuda::device_count() > 0;
#else
    return false;
#endif
  }, "True when this build has the CUDA executor and a CUDA device is usable.");
}
