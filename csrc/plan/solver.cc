// Sizing solver (Eqs. 13-14, App. G) and the recoverable-overhead fraction (Eq. 1).
#include <algorithm>
#include <cmath>
#include <utility>

#include "tide/plan.h"

namespace tide {

// Contributors c = 1..M (Eq. 6) are served in increasing order in waves of W_wave; c = M is the
// own node, which needs no rail transfer. Each wave's remote contributors go out at most k per
// round, so N_rounds(M-1, k, W_wave) = sum over waves of ceil(remote contributors in wave / k).
int n_rounds(int M, int k, int w_wave) {
  TIDE_CHECK(M >= 1 && k >= 1 && w_wave >= 1, "M=", M, " k=", k, " w_wave=", w_wave);
  int rounds = 0;
  for (int first = 1; first <= M; first += w_wave) {
    const int last = std::min(first + w_wave - 1, M);
    const int remote = std::min(last, M - 1) - first + 1;
    if (remote > 0) rounds += (remote + k - 1) / k;
  }
  return rounds;
}

namespace {
// Calibration ranges (a measured machine lies well inside them): bandwidths 1 MB/s .. 1 PB/s,
// the per-round wait 0 .. 10 s, the skew factor 1 .. 16, the tail share (0, 1], k_max up to the
// round widths App. D validates. Outside them the solver's formulas have no meaning.
void check_range(double v, double lo, double hi, bool lo_open, const char* name) {
  TIDE_PLAN_CHECK(std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi, "Calibration.", name,
                  ": expected a finite value in ", lo_open ? "(" : "[", lo, ", ", hi, "], got ", v);
}
// A CTA count from the solver's formulas, saturated at the executors' ceiling (kMaxCtas).
int cta_count(double need) { return static_cast<int>(std::max(1.0, std::min<double>(kMaxCtas, need))); }
}  // namespace

void validate_calibration(const Calibration& cal) {
  const std::pair<double, const char*> bws[] = {{cal.bw_nic, "bw_nic"},   {cal.bw_sum, "bw_sum"},
                                                {cal.bw_land, "bw_land"}, {cal.bw_cap, "bw_cap"},
                                                {cal.bw_push, "bw_push"}, {cal.bw_hbm, "bw_hbm"}};
  for (const auto& [v, name] : bws) check_range(v, 1e6, 1e15, false, name);
  check_range(cal.t_rnd, 0.0, 10.0, false, "t_rnd");
  check_range(cal.gamma_skew, 1.0, 16.0, false, "gamma_skew");
  check_range(cal.eta_tail, 0.0, 1.0, true, "eta_tail");
  TIDE_PLAN_CHECK(cal.k_max >= 1 && cal.k_max <= kMaxRoundWidth, "Calibration.k_max: expected 1..", kMaxRoundWidth,
                  ", got ", cal.k_max);
}

SolverResult solve(const GroupLayout& layout, const Topology& topo, const Options& opt,
                   const Calibration& cal) {
  validate_calibration(cal);
  const int M = topo.nodes, L = topo.gpus_per_node;
  const int w_wave = opt.w_wave ? opt.w_wave : L;
  SolverResult r;
  r.n_part = opt.n_part;
  r.t_nic = (M - 1) * static_cast<double>(layout.S_fp32) / cal.bw_nic;

  // Eq. 13, read as C_sum = ceil(gamma_skew * (L*b_grad/4 + 1) * BW_NIC / BW_sum): a sum CTA reads
  // L staged slices (L*b_grad bytes per 4 output bytes) and writes one fp32 partial, and the sum
  // CTAs together must keep up with one rail. L = 8, bf16: ceil(1.5 * 5 * 47.5/99) = ceil(3.60) = 4.
  const double b_grad = static_cast<double>(layout.S_grad) / layout.E;  // gradient itemsize
  // One node has no rail to keep pace with; the read deadline (§4.1) is then the pushes: the
  // sums keep up with the L-1 peers' copy-engine pushes into the owner, (L-1) b_grad/4 staged
  // bytes per output byte at BW_push (L = 8, bf16: ceil(1.5 * 5 * (360/3.5) / 99) = 8). A
  // single rank (L = 1) has no pushes: its one sum (FSDP2's _chunk_cat, at HBM speed) is the
  // whole call, so it gets the CTAs that read and write at BW_hbm.
  const double out_rate = M > 1 ? cal.bw_nic
                          : L > 1 ? cal.bw_push / ((L - 1) * b_grad / 4.0)
                                  : cal.bw_hbm / (L * b_grad / 4.0 + 1.0) / cal.gamma_skew;
  r.sum_ctas = cta_count(std::ceil(cal.gamma_skew * (L * b_grad / 4.0 + 1.0) * out_rate / cal.bw_sum - 1e-9));

  // Eq. 14, read as C_mc = min(floor(BW_cap/BW_land), ceil((S_fp32/n_part) /
  // (eta_tail * t_NIC * BW_land))): enough landing CTAs that the last wave's landing (one pass of
  // the output) takes at most eta_tail of the wire time, but no more than the fabric ceiling
  // feeds. At M = 8: min(floor(90/21) = 4, ceil(47.5/(0.05*7*21)) = 7) = 4.
  const int cap = cta_count(std::floor(cal.bw_cap / cal.bw_land));
  if (r.t_nic > 0) {
    const double need = (static_cast<double>(layout.S_fp32) / opt.n_part) /
                        (cal.eta_tail * r.t_nic * cal.bw_land);
    r.land_ctas = std::min(cap, cta_count(std::ceil(need - 1e-9)));
  } else {
    // One node: no wire time to hide the landing behind (t_NIC = 0), so the landing is on the
    // call's critical path; Eq. 14's bound in that limit is the fabric ceiling alone.
    r.land_ctas = cap;
  }

  // App. G: k starts at min(2, M-1) and doubles (up to k_max) while the per-round wait overhead
  // exceeds 10% of the wire time and doubling actually reduces the round count.
  if (M == 1) {
    r.k = 1;  // no rail transfers at all; 1 keeps downstream sizing well defined
  } else {
    r.k = std::min(2, M - 1);
    while (true) {
      const int next = std::min(2 * r.k, cal.k_max);
      if (next <= r.k) break;
      const int now = n_rounds(M, r.k, w_wave);
      if (!(now * cal.t_rnd > 0.10 * r.t_nic)) break;
      if (n_rounds(M, next, w_wave) >= now) break;
      r.k = next;
    }
  }

  if (opt.k > 0) { r.k = opt.k; r.k_given = true; }
  if (opt.sum_ctas > 0) { r.sum_ctas = opt.sum_ctas; r.sum_ctas_given = true; }
  if (opt.land_ctas > 0) { r.land_ctas = opt.land_ctas; r.land_ctas_given = true; }
  r.rounds = M > 1 ? n_rounds(M, r.k, w_wave) : 0;
  return r;
}

// Eq. 1: the recoverable FSDP overhead fraction is proportional to Psi_total / (Psi_active *
// T_tok/gpu); returned with the proportionality constant set to 1.
double recoverable_overhead_fraction(double psi_total, double psi_active, double tokens_per_gpu) {
  TIDE_PLAN_CHECK(psi_total > 0, "psi_total: must be > 0, got ", psi_total);
  TIDE_PLAN_CHECK(psi_active > 0, "psi_active: must be > 0, got ", psi_active);
  TIDE_PLAN_CHECK(tokens_per_gpu > 0, "tokens_per_gpu: must be > 0, got ", tokens_per_gpu);
  return psi_total / (psi_active * tokens_per_gpu);
}

}  // namespace tide
