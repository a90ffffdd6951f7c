// Capability probe of one CUDA device (probe.cu). Ranks compare these before installing a plan
// (inconsistent capabilities abort); the multicast fields only report, they never open the path.
#pragma once

#include <string>

#include "tide/cuda.h"  // device_count()

namespace tide::cuda {

struct Capabilities {
  int device = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int async_engines = 0;          // copy engines
  int smem_optin = 0;             // bytes of shared memory per block after opt-in
  int l2_bytes = 0;
  bool memops64 = false;          // 64-bit stream memory operations (signals/waits)
  bool multicast_supported = false;  // driver attribute (querying is safe)
  bool multicast_allowed = false;    // the full safety gate (runtime.h multicast_allowed)
};

Capabilities probe_capabilities(int device);

}  // namespace tide::cuda
