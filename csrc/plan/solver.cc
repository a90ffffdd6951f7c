// Sizing solver (Eqs. 13-14, App. G) and Eq. 1. Owner: solver. Placeholder.
#include <algorithm>

#include "tide/plan.h"

namespace tide {

SolverResult solve(const GroupLayout& layout, const Topology& topo, const Options& opt,
                   const Calibration& cal) {
  SolverResult r;
  r.k = std::max(1, std::min(4, topo.nodes - 1));
  r.sum_ctas = 4;
  r.land_ctas = 4;
  return r;
}

double recoverable_overhead_fraction(double psi_total, double psi_active, double tokens_per_gpu) {
  return psi_total / (psi_active * tokens_per_gpu);
}

}  // namespace tide
