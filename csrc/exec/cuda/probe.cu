// Capability probe: is a CUDA device usable from this process? Safe on machines with no GPU
// and no driver (cudart is linked statically and reports an error instead of failing to load).
#include <cuda_runtime_api.h>

namespace tide::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return n;
}

}  // namespace tide::cuda
