// Validator (Prop. 4.1, App. D). Owner: TIDE-RS. Placeholder until the validator lands.
#include "tide/plan.h"

namespace tide {

void validate_rs(const RsSchedule& rs, const Topology& topo, const Options& opt) {}

}  // namespace tide
