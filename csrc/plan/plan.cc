// make_plan(): composes the per-file builders into one immutable Plan, and hashes it.
#include "tide/plan.h"

namespace tide {

namespace {
constexpr uint32_t kPlanHashVersion = 1;  // bump when the plan's meaning changes
// FNV-1a over the inputs that determine a plan; identical on every rank for identical inputs.
struct Hasher {
  uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, size_t n) {
    auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) { h ^= b[i]; h *= 1099511628211ull; }
  }
  template <typename T> void pod(const T& v) { bytes(&v, sizeof(v)); }
};
}  // namespace

Plan make_plan(const GroupSignature& sig, const Topology& topo, const Options& opt_in,
               const Calibration& cal) {
  validate_inputs(sig, topo, opt_in);
  Plan plan;
  plan.sig = sig;
  plan.topo = topo;
  plan.opt = opt_in;
  plan.layout = build_layout(sig, topo);
  plan.solver = solve(plan.layout, topo, opt_in, cal);
  if (plan.opt.w_wave == 0) plan.opt.w_wave = topo.gpus_per_node;
  // solve() already applied every explicit (nonzero) option; these are the resolved values.
  plan.opt.k = plan.solver.k;
  plan.opt.sum_ctas = plan.solver.sum_ctas;
  plan.opt.land_ctas = plan.solver.land_ctas;
  plan.opt.n_part = plan.solver.n_part;
  plan.ag = build_ag_schedule(plan.layout, sig, topo, plan.opt);
  plan.rs = build_rs_schedule(plan.layout, topo, plan.opt);
  validate_rs(plan.rs, topo, plan.opt);
  plan.memory = build_memory(plan);

  // Hash only fixed-width fields, in a fixed order, so every rank (and every build of this
  // version) gets the same value for the same inputs; parameter names do not change the plan.
  Hasher h;
  h.pod(kPlanHashVersion);
  h.pod(topo.nodes);
  h.pod(topo.gpus_per_node);
  h.pod(sig.ag_dtype);
  h.pod(sig.grad_dtype);
  h.pod(sig.shard_dtype);
  for (const auto& p : sig.params) {
    h.pod(static_cast<uint64_t>(p.shape.size()));
    for (auto d : p.shape) h.pod(d);
  }
  const Options& o = plan.opt;
  h.pod(o.mode); h.pod(o.w_wave); h.pod(o.k); h.pod(o.n_part); h.pod(o.n_stg);
  h.pod(o.chunk_bytes); h.pod(o.sum_ctas); h.pod(o.land_ctas); h.pod(o.ag_head_bytes);
  plan.hash = h.h;
  return plan;
}

}  // namespace tide
