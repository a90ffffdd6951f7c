// Internal to csrc/exec/cpu: the run-wide state kept at the start of the arena mapping.
#pragma once

#include <atomic>
#include <cstdint>

#include "tide/exec_cpu.h"

namespace tide {

// Lives in the (possibly shared) mapping, so forked ranks see the abort flag and can report
// the first error to the parent. Lock-free atomics only.
struct CpuArena::Shared {
  std::atomic<int> abort{0};       // set by the first failing rank; everyone stops
  std::atomic<int> claimed{0};     // first error slot claimed
  std::atomic<int> error_kind{0};  // 1 = Error, 2 = TimeoutError
  char message[4096] = {};
};

}  // namespace tide
