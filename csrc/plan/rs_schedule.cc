// TIDE-RS schedule (Section 4): sub-slices, Latin square, waves, generations, spares.
// Owner: TIDE-RS. Placeholder until the RS schedule lands.
#include <algorithm>

#include "tide/plan.h"

namespace tide {

RsSchedule build_rs_schedule(const GroupLayout& layout, const Topology& topo, const Options& opt) {
  RsSchedule rs;
  const int M = topo.nodes, L = topo.gpus_per_node;
  rs.w_wave = opt.w_wave ? opt.w_wave : L;
  rs.waves = (M + rs.w_wave - 1) / rs.w_wave;
  rs.n_par = rs.waves > 1 ? 2 : 1;
  rs.n_part = opt.n_part;
  rs.k = opt.k;
  rs.n_out = opt.mode == Mode::kInPlace ? std::max(M - 1, 0) : 2 * opt.k;
  rs.E_stg = (layout.E + opt.n_part - 1) / opt.n_part;
  const int64_t per = (rs.E_stg + L - 1) / L;
  rs.E_sub = (per + kVectorElems - 1) / kVectorElems * kVectorElems;
  rs.block_bytes = 4 * static_cast<int64_t>(L) * rs.E_sub;
  return rs;
}

}  // namespace tide
