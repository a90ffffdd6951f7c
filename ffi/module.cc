// tide_xla._ffi: exports the TIDE FFI handlers as capsules in one `registrations()` dict.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "tide_ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherHandler);          // all_gather.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterHandler);      // reduce_scatter.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherVirtualHandler);   // all_gather.cc (virtual cluster)
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterVirtualHandler);  // reduce_scatter.cc
#ifdef TIDE_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherCudaHandler);      // all_gather.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterCudaHandler);  // reduce_scatter.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherVirtualCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterVirtualCudaHandler);
#endif

namespace {

template <typename Fn>
nb::capsule encapsulate(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "TIDE XLA FFI handlers (TIDE-AG, TIDE-RS) over the shared C++ core";
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef TIDE_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  // {platform: {target name: handler capsule}}; platform names as jax.ffi.register_ffi_target
  // takes them.
  m.def("registrations", []() {
    nb::dict cpu;
    cpu["tide_all_gather"] = encapsulate(AllGatherHandler);
    cpu["tide_reduce_scatter"] = encapsulate(ReduceScatterHandler);
    cpu["tide_all_gather_virtual"] = encapsulate(AllGatherVirtualHandler);
    cpu["tide_reduce_scatter_virtual"] = encapsulate(ReduceScatterVirtualHandler);
    nb::dict out;
    out["cpu"] = cpu;
#ifdef TIDE_WITH_CUDA
    nb::dict cuda;
    cuda["tide_all_gather"] = encapsulate(AllGatherCudaHandler);
    cuda["tide_reduce_scatter"] = encapsulate(ReduceScatterCudaHandler);
    cuda["tide_all_gather_virtual"] = encapsulate(AllGatherVirtualCudaHandler);
    cuda["tide_reduce_scatter_virtual"] = encapsulate(ReduceScatterVirtualCudaHandler);
    out["CUDA"] = cuda;
#endif
    return out;
  });
  m.def("executor_available", &tide::xla_ffi::executor_available,
        "True when this build's CPU handlers can run collectives (the executor is linked).");
  m.def("executor_description", &tide::xla_ffi::executor_description);
}
