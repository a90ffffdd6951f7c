// TIDE-AG schedule (Section 3): Bruck rounds, stage slots, strided scatter descriptors.
// Owner: TIDE-AG. Placeholder until the AG schedule lands.
#include <algorithm>

#include "tide/plan.h"

namespace tide {

AgSchedule build_ag_schedule(const GroupLayout& layout, const GroupSignature& sig,
                             const Topology& topo, const Options& opt) {
  AgSchedule ag;
  const int M = topo.nodes;
  while ((1 << ag.rounds) < M) ++ag.rounds;
  for (int d = 0; d < ag.rounds; ++d) ag.c.push_back(std::min(1 << d, M - (1 << d)));
  ag.stage_slots = M > 1 ? (sig.needs_cast() ? M : M - 1) : (sig.needs_cast() ? 1 : 0);
  ag.stage_bytes = ag.stage_slots * layout.S;
  return ag;
}

}  // namespace tide
