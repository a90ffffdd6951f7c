// TIDE-AG schedule (Section 3): Bruck rounds, stage slots, strided scatter descriptors.
#include <algorithm>

#include "tide/plan.h"

namespace tide {

std::vector<AgScatterRun> ag_scatter_runs(const AgSchedule& ag, int M, int node) {
  std::vector<AgScatterRun> runs;
  for (int d = 0; d < ag.rounds; ++d) {
    const int first = 1 << d, count = ag.c[d];
    // Scatter groups: one per round, the last round split into <= 4 near-equal groups.
    const int groups = d + 1 == ag.rounds ? std::min(count, kAgLastRoundGroups) : 1;
    int start = first;
    for (int g = 0; g < groups; ++g) {
      const int len = count / groups + (g < count % groups ? 1 : 0);
      // Break at the mod-M wrap: slot i holds node (node + i) mod M, so the destination rank
      // jumps back when (node + i) mod M wraps to 0.
      int s = start;
      const int end = start + len;
      while (s < end) {
        const int wrap_slot = M - node;  // first slot holding node 0 (if inside [s, end))
        const int stop = (wrap_slot > s && wrap_slot < end) ? wrap_slot : end;
        runs.push_back({d, s, stop - s});
        s = stop;
      }
      start = end;
    }
  }
  return runs;
}

int64_t ag_scatter_descriptors(const AgSchedule& ag, int M, int P, int node) {
  int64_t n = 0;
  for (const auto& run : ag_scatter_runs(ag, M, node)) n += ag_run_descriptors(run, P);
  return n;
}

std::vector<int64_t> ag_ring_slot_bytes(const std::vector<int64_t>& group_ns_bytes) {
  std::vector<int64_t> slot(2, 0);
  for (size_t g = 0; g < group_ns_bytes.size(); ++g)
    slot[g % 2] = std::max(slot[g % 2], group_ns_bytes[g]);
  return slot;
}

void ag_bruck_rounds(int M, int* rounds, std::vector<int>* c) {
  *rounds = 0;
  while ((1 << *rounds) < M) ++*rounds;
  c->clear();
  for (int d = 0; d < *rounds; ++d) c->push_back(std::min(1 << d, M - (1 << d)));
}

AgSchedule build_ag_schedule(const GroupLayout& layout, const GroupSignature& sig,
                             const Topology& topo, const Options& opt) {
  AgSchedule ag;
  const int M = topo.nodes;
  ag_bruck_rounds(M, &ag.rounds, &ag.c);
  ag.stage_slots = M > 1 ? (sig.needs_cast() ? M : M - 1) : (sig.needs_cast() ? 1 : 0);
  ag.stage_bytes = ag.stage_slots * layout.S;
  ag.last_round_groups = ag.rounds ? std::min(ag.c.back(), kAgLastRoundGroups) : 0;
  ag.local_push_descriptors = layout.P;
  ag.flat_descriptors_per_rank = static_cast<int64_t>(M - 1) * layout.P;
  for (int n = 0; n < M; ++n)
    ag.descriptors_per_rank =
        std::max(ag.descriptors_per_rank, ag_scatter_descriptors(ag, M, layout.P, n));
  return ag;
}

}  // namespace tide
