// Memory model (Section 5.4, Eqs. 10-12), the arena layout and the pulled TIDE-AG's arena.
#include <algorithm>

#include "tide/plan.h"

namespace tide {

namespace {
int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
}  // namespace

const ArenaRegion& MemoryModel::region(const std::string& name) const {
  for (const auto& r : arena)
    if (r.name == name) return r;
  std::string have;
  for (const auto& r : arena) have += (have.empty() ? "" : ", ") + r.name;
  throw Error(TIDE_STR_CAT("MemoryModel.region: this plan's arena has no region '", name,
                           "' (regions: ", have, ")"));
}

int64_t live_bytes_besides_rs(const Plan& plan) {
  const GroupLayout& g = plan.layout;
  const bool in_place = plan.opt.mode == Mode::kInPlace;
  return 2 * g.unsharded_bytes() + plan.ag.stage_bytes + (in_place ? static_cast<int64_t>(g.N) * g.S_grad : 0);
}

int64_t live_fsdp2_bytes(const GroupLayout& g) { return 2 * g.unsharded_bytes() + g.B_pack; }

MemoryModel build_memory(const Plan& plan) {
  const GroupLayout& g = plan.layout;
  const RsSchedule& rs = plan.rs;
  const int M = plan.topo.nodes, L = plan.topo.gpus_per_node, N = plan.topo.world();
  const int b_ag = dtype_size(plan.sig.ag_dtype);
  const int n_stg = plan.opt.n_stg;
  MemoryModel mm;
  mm.ns_bytes = g.unsharded_bytes();
  TIDE_CHECK(mm.ns_bytes > 0, "empty group reached the memory model");
  const double ns = static_cast<double>(mm.ns_bytes);

  // Terms of Eq. 10 as laid out. One staging slot holds, for each of the L-1 local peers, the
  // rows of one chunk in the gradient dtype: L rows of a sub-slice's chunk, or one row of the
  // output's chunk when one node has no Level 2 ([Note: direct Level 1]); the planner's chunk keeps
  // the n_stg slots within one output block, which is how "fixed-size chunks lower In-Place to
  // 0.56 NS". A direct schedule has no inbox, outbox or spare.
  mm.staging_slot_bytes = rs.stg_slot_bytes;
  mm.staging_bytes = n_stg * mm.staging_slot_bytes;
  mm.inbox_bytes = static_cast<int64_t>(rs.n_par) * L * rs.block_bytes;
  mm.outbox_bytes = 2ll * rs.n_out * rs.block_bytes;
  mm.spare_bytes = 2ll * rs.n_spare * rs.block_bytes;
  mm.area_rs_bytes = mm.staging_bytes + mm.inbox_bytes + mm.outbox_bytes + mm.spare_bytes;
  TIDE_CHECK(mm.area_rs_bytes == rs_scratch_bytes(rs), "memory model and schedule disagree on RS scratch");
  mm.area_rs_ns = mm.area_rs_bytes / ns;

  // Closed forms, in units of S_fp32 (the block size), converted to NS with
  // S_fp32 / NS = 4E / (N E b_ag) = 4 / (N b_ag) (exact: padding is in both).
  //   Eq. 10: Area_RS <= (n_stg*L*b_grad/4 + L*n_par + 2 n_out + 2) S_fp32; at L = 8, bf16 this is
  //           the paper's (4 n_stg + 8 n_par + 2 n_out + 2) S_fp32 (a staging slot <= 4 S_fp32,
  //           a generation 8 blocks, two outbox banks, one spare per bank).
  //   Eq. 11: n_out = M-1 -> (2M + 8 n_par + 8) S_fp32 = (1/2 + (2 n_par + 2)/M) NS at L = 8.
  //   Eq. 12: n_out = 2k  -> (4k + 8 n_par + 10) S_fp32 = (2k + 4 n_par + 5)/(2M) NS at L = 8.
  const double sfp32_per_ns = 4.0 / (static_cast<double>(N) * b_ag);
  // Staging term: the paper's n_stg*L*b_grad/4 S_fp32 for whole-sub-slice staging (a slot <=
  // L*b_grad/4 S_fp32); chunked (the planner's chunk: about one block), the slots as laid out.
  const bool chunked = rs.direct || rs.n_chunks > 1 || rs.n_part > 1;
  const double staging_blocks = chunked ? static_cast<double>(mm.staging_bytes) / g.S_fp32
                                        : n_stg * L * dtype_size(plan.sig.grad_dtype) / 4.0;
  auto bound_ns = [&](double n_out) {
    if (rs.direct) return staging_blocks * sfp32_per_ns;
    const double per_block = 1.0 / rs.n_part;  // a pass's block is 1/n_part of S_fp32
    return (staging_blocks + (static_cast<double>(L) * rs.n_par + 2.0 * n_out + 2.0) * per_block) *
           sfp32_per_ns;
  };
  mm.area_rs_bound_ns = bound_ns(rs.n_out);
  mm.area_inplace_bound_ns = bound_ns(rs.direct ? 0 : std::max({M - 1, rs.n_out}));
  mm.area_slot_bound_ns = bound_ns(rs.direct ? 0 : 2.0 * rs.k);
  // Live bytes during a layer's backward. FSDP2: this layer's unsharded parameters, the
  // prefetched AG output and the previous layer's packed fp32 RS input (B_pack = 2 NS for bf16).
  // TIDE: two ring slots and the receive stage replace the first two ((2 + 1/L) NS, exactly
  // 2 NS + (M-1)S, or MS with a cast), plus the RS staging and, for In-Place, the previous layer's
  // gradients (Slot-Reuse keeps them in a vacated ring slot).
  const bool in_place = plan.opt.mode == Mode::kInPlace;
  mm.ring_bytes = 2 * mm.ns_bytes;
  mm.stage_bytes = plan.ag.stage_bytes;
  mm.prev_grad_bytes = in_place ? static_cast<int64_t>(N) * g.S_grad : 0;
  mm.live_tide_bytes = live_bytes_besides_rs(plan) + mm.area_rs_bytes;
  mm.live_tide_ns = mm.live_tide_bytes / ns;
  mm.live_tide_bound_ns = 2.0 + 1.0 / L +
                          (in_place ? mm.area_inplace_bound_ns : mm.area_slot_bound_ns) +
                          mm.prev_grad_bytes / ns;
  mm.live_fsdp2_bytes = live_fsdp2_bytes(g);
  mm.live_fsdp2_ns = mm.live_fsdp2_bytes / ns;

  // Arena: fixed region order, each offset 4 KiB aligned.
  int64_t off = 0;
  auto add = [&](const char* name, int64_t bytes) {
    off = align_up(off, kArenaAlign);
    mm.arena.push_back({name, off, bytes});
    off += bytes;
  };
  add("ring0", mm.ns_bytes);
  add("ring1", mm.ns_bytes);
  if (!plan.sig.needs_cast()) add("resident", g.S);
  add("stage", mm.stage_bytes);
  add("staging", mm.staging_bytes);
  add("outbox", mm.outbox_bytes);
  add("inbox", mm.inbox_bytes);
  add("spare", mm.spare_bytes);
  add("counters", kCounterBytes);
  mm.arena_bytes = align_up(off, kArenaAlign);
  return mm;
}

std::vector<ArenaRegion> pull_arena(const Plan& plan, int num_counters) {
  TIDE_PLAN_CHECK(num_counters >= 0, "pull_arena: num_counters must be >= 0, got ", num_counters);
  std::vector<ArenaRegion> out;
  int64_t off = 0;
  auto add = [&](const char* name, int64_t bytes) {
    off = align_up(off, kArenaAlign);
    out.push_back({name, off, bytes});
    off += bytes;
  };
  if (!plan.sig.needs_cast()) add("resident", plan.layout.S);
  add("stage", plan.ag.stage_bytes);
  add("counters", 8ll * num_counters);
  return out;
}

}  // namespace tide
