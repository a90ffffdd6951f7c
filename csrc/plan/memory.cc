// Memory model (Section 5.4, Eqs. 10-12) and arena layout. Owner: memory. Placeholder.
#include "tide/plan.h"

namespace tide {

MemoryModel build_memory(const Plan& plan) { return MemoryModel{}; }

}  // namespace tide
