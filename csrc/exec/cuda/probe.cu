// Capability probe: is a CUDA device usable from this process, and what can it do? Safe on
// machines with no GPU and no driver (cudart is linked statically and reports an error instead
// of failing to load). Querying CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is safe; nothing here
// creates or binds a multicast object.
#include <cuda_runtime_api.h>

#include "exec/cuda/probe.h"
#include "exec/cuda/runtime.h"
#include "tide/errors.h"

namespace tide::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return n;
}

Capabilities probe_capabilities(int device) {
  Capabilities c;
  c.device = device;
  TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&c.sm_count, cudaDevAttrMultiProcessorCount, device));
  TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&c.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&c.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&c.async_engines, cudaDevAttrAsyncEngineCount, device));
  TIDE_CHECK_CUDA(cudaDeviceGetAttribute(&c.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  int v = 0;
  check_cu(driver().device_get_attribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device),
           "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS)");
  c.memops64 = v != 0;
  check_cu(driver().device_get_attribute(&v, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, device),
           "cuDeviceGetAttribute(MULTICAST_SUPPORTED)");
  c.multicast_supported = v != 0;
  c.multicast_allowed = multicast_allowed(device);
  cudaDeviceProp p{};
  TIDE_CHECK_CUDA(cudaGetDeviceProperties(&p, device));
  c.l2_bytes = p.l2CacheSize;
  c.name = p.name;
  return c;
}

}  // namespace tide::cuda
