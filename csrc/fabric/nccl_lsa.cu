// The one-time LSA-pointer kernel of the NCCL fabric (nccl.h). NCCL 2.28 has no host getter for
// a window's peer addresses: ncclGetLsaPointer is a device function reading the device-resident
// ncclWindow_vidmem, so a single thread evaluates it for every LSA peer (as PyTorch's
// NCCLSymmetricMemory does). Compiled against the headers of the loaded library (the layout of
// ncclWindow_vidmem changed between 2.28 and 2.32; nccl.cc refuses a major.minor mismatch).
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <nccl_device.h>

#include "fabric/nccl.h"
#include "tide/errors.h"

namespace tide::fabric::detail {

namespace {
__global__ void lsa_pointers(ncclWindow_t win, int n, void** out, int* ranks) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (int p = 0; p < n; ++p) out[p] = ncclGetLsaPointer(win, 0, p);
  ranks[0] = win->lsaRank;
  ranks[1] = win->worldRank;
}
}  // namespace

void launch_lsa_pointers(void* win, int n, void** out, int* ranks, void* stream) {
  lsa_pointers<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<ncclWindow_t>(win), n, out, ranks);
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching the NCCL LSA-pointer kernel");
}

}  // namespace tide::fabric::detail
