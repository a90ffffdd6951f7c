// make_plan(): composes the per-file builders into one immutable Plan, and hashes it.
#include <cstdio>

#include "tide/plan.h"

namespace tide {

namespace {
constexpr uint32_t kPlanHashVersion = 2;  // bump when the plan's meaning changes
// FNV-1a over the inputs that determine a plan; identical on every rank for identical inputs.
struct Hasher {
  uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, size_t n) {
    auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) { h ^= b[i]; h *= 1099511628211ull; }
  }
  template <typename T> void pod(const T& v) { bytes(&v, sizeof(v)); }
};
// The planner's pass count (Options.n_part = 0; Section 5.4, Fig. 10b): the fewest passes
// (1..kMaxAutoPasses) whose RS scratch fits kRsScratchBlocks output-sized blocks and whose live
// bytes during a layer's backward stay within FSDP2's; failing both, the fewest within FSDP2's;
// failing that, the fewest live bytes. One node has no Level 2 and always takes one pass.
int choose_passes(const Plan& plan, std::string* why) {
  if (plan.topo.nodes == 1) {
    *why = "n_part 1 (one node: no Level 2, the Level-1 SUM writes the output)";
    return 1;
  }
  const GroupLayout& g = plan.layout;
  const double ns = static_cast<double>(g.unsharded_bytes());
  const int64_t fsdp2 = live_fsdp2_bytes(g);
  const int64_t fixed = live_bytes_besides_rs(plan);  // the memory model's, without the RS scratch
  int64_t scratch[kMaxAutoPasses + 1] = {};
  int pick = 0, within = 0, best = 1;
  for (int n = 1; n <= kMaxAutoPasses; ++n) {
    Options o = plan.opt;
    o.n_part = n;
    scratch[n] = rs_scratch_bytes(size_rs_schedule(g, plan.topo, o));
    const bool fits = fixed + scratch[n] <= fsdp2;
    if (!pick && fits && scratch[n] <= kRsScratchBlocks * g.S_fp32) pick = n;
    if (!within && fits) within = n;
    if (scratch[n] < scratch[best]) best = n;
  }
  const int n = pick ? pick : within ? within : best;
  auto fixed2 = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", v);
    return std::string(buf);
  };
  auto blocks = [&](int k) { return fixed2(static_cast<double>(scratch[k]) / g.S_fp32); };
  std::string because;
  if (n == 1)
    because = pick ? "one pass fits" : "no pass count fits better";
  else
    because = TIDE_STR_CAT("one pass would hold ", blocks(1), " output blocks of RS scratch (",
                           fixed2((fixed + scratch[1]) / ns), " NS live vs FSDP2's ", fixed2(fsdp2 / ns), " NS)");
  *why = TIDE_STR_CAT("n_part ", n, " (planner: ", blocks(n), " output blocks of RS scratch, ceiling ",
                      kRsScratchBlocks, "; ", because, ")");
  return n;
}
// kMaxArenaBytes (tide/plan.h, "Option ranges"): a larger arena is refused naming its largest region.
void check_arena_size(const MemoryModel& mm) {
  if (mm.arena_bytes <= kMaxArenaBytes) return;
  const ArenaRegion* big = &mm.arena.front();
  for (const auto& r : mm.arena)
    if (r.bytes > big->bytes) big = &r;
  throw PlanError(TIDE_STR_CAT("plan: the arena needs ", mm.arena_bytes, " bytes per rank, above TIDE's limit of ",
                               kMaxArenaBytes, " (1 TiB); its largest region is '", big->name, "' (", big->bytes,
                               " bytes)", big->name == "staging" ? " (Options.n_stg slots of Options.chunk_bytes pieces)" : ""));
}
}  // namespace

Plan make_plan(const GroupSignature& sig, const Topology& topo, const Options& opt_in,
               const Calibration& cal) {
  validate_inputs(sig, topo, opt_in);
  Plan plan;
  plan.sig = sig;
  plan.topo = topo;
  plan.opt = opt_in;
  plan.layout = build_layout(sig, topo);
  Options sized = opt_in;
  if (sized.n_part == 0) sized.n_part = 1;  // the landing budget depends on passes: re-solved below
  plan.solver = solve(plan.layout, topo, sized, cal);
  if (plan.opt.w_wave == 0) plan.opt.w_wave = topo.gpus_per_node;
  plan.opt.k = plan.solver.k;  // the round width does not depend on passes
  plan.ag = build_ag_schedule(plan.layout, sig, topo, plan.opt);
  if (plan.opt.n_part == 0 || topo.nodes == 1) {
    // One node: passes split Level 2, which it does not have ([Note: direct Level 1]); a given
    // n_part changes no result there, so it is resolved to 1 and rs_sizing says so.
    const int given = plan.opt.n_part;
    plan.opt.n_part = choose_passes(plan, &plan.rs_sizing);
    if (given > 1) plan.rs_sizing += TIDE_STR_CAT(" (n_part ", given, " given: no passes without Level 2)");
    sized.n_part = plan.opt.n_part;
    plan.solver = solve(plan.layout, topo, sized, cal);
  } else {
    plan.rs_sizing = TIDE_STR_CAT("n_part ", plan.opt.n_part, " (given)");
  }
  // solve() already applied every explicit (nonzero) option; these are the resolved values.
  plan.opt.sum_ctas = plan.solver.sum_ctas;
  plan.opt.land_ctas = plan.solver.land_ctas;
  plan.rs = build_rs_schedule(plan.layout, topo, plan.opt);
  validate_rs(plan.rs, topo, plan.opt);
  plan.memory = build_memory(plan);
  check_arena_size(plan.memory);
  plan.rs_sizing += TIDE_STR_CAT("; staging chunk ", plan.rs.E_chunk * plan.rs.b_grad, " B per piece x ",
                                 plan.rs.n_chunks, " chunk(s) per ", plan.rs.direct ? "output" : "sub-slice",
                                 plan.opt.chunk_bytes > 0 ? " (given)" : " (planner: n_stg slots within one output block)");

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
