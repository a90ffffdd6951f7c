// Layout (Section 2.1, Eqs. 2-3) and input validation.
#include <algorithm>
#include <cmath>

#include "tide/plan.h"

namespace tide {

int dtype_size(DType t) {
  switch (t) {
    case DType::kBF16: return 2;
    case DType::kFP16: return 2;
    case DType::kFP32: return 4;
    case DType::kU8: return 1;
  }
  throw Error("unknown DType");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kFP16: return "float16";
    case DType::kFP32: return "float32";
    case DType::kU8: return "uint8";
  }
  return "?";
}

DType parse_dtype(const std::string& name, const char* field) {
  if (name == "bfloat16" || name == "bf16") return DType::kBF16;
  if (name == "float16" || name == "fp16" || name == "half") return DType::kFP16;
  if (name == "float32" || name == "fp32" || name == "float") return DType::kFP32;
  // [Note: byte items] FP8 data is gathered as bytes: the float8 names are the same 1-byte item.
  if (name == "uint8" || name == "float8_e4m3fn" || name == "float8_e5m2") return DType::kU8;
  throw PlanError(TIDE_STR_CAT(field, ": unknown dtype '", name,
                               "' (expected bfloat16, float16, float32, or a 1-byte item: uint8, float8_e4m3fn, "
                               "float8_e5m2)"));
}

const char* mode_name(Mode m) { return m == Mode::kInPlace ? "in_place" : "slot_reuse"; }

Mode parse_mode(const std::string& name) {
  if (name == "in_place" || name == "inplace" || name == "In-Place") return Mode::kInPlace;
  if (name == "slot_reuse" || name == "slotreuse" || name == "Slot-Reuse") return Mode::kSlotReuse;
  throw PlanError(TIDE_STR_CAT("mode: unknown mode '", name, "' (expected in_place or slot_reuse)"));
}

// [Note: byte items] A 1-byte item (DType::kU8: uint8, or FP8 data gathered as uint8) is an
// all-gather item only: TIDE-AG moves bytes and never does arithmetic on them. It is accepted as
// the AG dtype with the same shard dtype (no cast: resident/adopted shards or the user's shard
// buffers). Nothing else about the plan depends on the item size being 2 or 4:
//   - layout: s_p = R_p*K_p*b_ag and o_p is a plain prefix sum (no per-parameter alignment), so
//     o_p, landing offsets and shard sizes are byte-granular for every dtype already (bf16 with
//     odd R_p*K_p gives 2-byte-aligned offsets); copies do not rely on a 16-byte alignment: the
//     CPU executor copies bytes, the CUDA SM copy picks its unit (16/8/4/2/1 bytes) from the
//     addresses, width and pitches of each copy (kernels.cu sm_copy_vec), the copy engine takes
//     any alignment, and the AG head/tail split is on 16-byte boundaries of the byte stream;
//   - the AG schedule's descriptors (stage slot S, dst pitch L*s_p) are in bytes;
//   - the RS side (E, o32, S_fp32, staging, App. D's validator) is in elements of the fp32
//     output and the gradient dtype, which stays bfloat16, float16 or float32.
// Refused here, naming the field: a 1-byte grad_dtype (TIDE-RS sums gradients), and a cast to
// or from a 1-byte item.
// [Note: dtypes] Gradients are bfloat16, float16 or float32: every SUM/LAND term is widened
// exactly to fp32 and summed there (tide/numerics.h), whatever the gradient dtype. A shard dtype
// other than the all-gather dtype means the AG's CAST, which is fp32 -> bfloat16 or fp32 ->
// float16, round-to-nearest-even (torch's `.to()` bit for bit); any other pair is refused.
void validate_signature(const GroupSignature& sig, int world) {
  TIDE_PLAN_CHECK(world >= 1, "world: must be >= 1, got ", world);
  TIDE_PLAN_CHECK(sig.grad_dtype != DType::kU8, "GroupSignature.grad_dtype: ", dtype_name(sig.grad_dtype),
                  " (1-byte items) is an all-gather item only; TIDE-RS sums bfloat16, float16 or float32 gradients");
  TIDE_PLAN_CHECK(sig.ag_dtype != DType::kU8 || sig.shard_dtype == DType::kU8, "GroupSignature.ag_dtype: ",
                  dtype_name(sig.ag_dtype), " (1-byte items) is gathered without a cast, but shard_dtype is ",
                  dtype_name(sig.shard_dtype), " (a cast to 1-byte items is not supported)");
  TIDE_PLAN_CHECK(sig.shard_dtype != DType::kU8 || sig.ag_dtype == DType::kU8, "GroupSignature.shard_dtype: ",
                  dtype_name(sig.shard_dtype), " (1-byte items) is gathered without a cast, but ag_dtype is ",
                  dtype_name(sig.ag_dtype), " (a cast from 1-byte items is not supported)");
  TIDE_PLAN_CHECK(!sig.needs_cast() || (sig.shard_dtype == DType::kFP32 &&
                                        (sig.ag_dtype == DType::kBF16 || sig.ag_dtype == DType::kFP16)),
                  "GroupSignature.shard_dtype: ", dtype_name(sig.shard_dtype), " shards gathered as ",
                  dtype_name(sig.ag_dtype), " (the all-gather casts float32 shards to bfloat16 or float16 only)");
  const int P = static_cast<int>(sig.params.size());
  TIDE_PLAN_CHECK(P >= 1, "GroupSignature.shapes: the group is empty (no parameters)");
  TIDE_PLAN_CHECK(P <= kMaxParams, "GroupSignature.shapes: ", P, " parameters exceed TIDE's limit of ",
                  kMaxParams, "; this group falls back to stock FSDP2 collectives");
  for (int p = 0; p < P; ++p) {
    const auto& ps = sig.params[p];
    const std::string who = TIDE_STR_CAT("parameter ", p, ps.name.empty() ? "" : " ('", ps.name,
                                         ps.name.empty() ? "" : "')");
    TIDE_PLAN_CHECK(!ps.shape.empty(), who, ": shape is empty (0-d tensors cannot be sharded on dim 0)");
    for (size_t i = 0; i < ps.shape.size(); ++i)
      TIDE_PLAN_CHECK(ps.shape[i] > 0, who, ": shape[", i, "] = ", ps.shape[i], " must be > 0");
  }
  // The group must stay addressable: NS = N * S bytes (and the fp32 RS input B_pack = 4N*E)
  // must fit in int64 with room for the arena's other regions.
  const long double limit = 1.0L * (1ll << 60);
  long double ns = 0;
  for (int p = 0; p < P; ++p) {
    const auto& sh = sig.params[p].shape;
    long double padded = std::ceil(static_cast<long double>(sh[0]) / world) * world;
    for (size_t i = 1; i < sh.size(); ++i) padded *= sh[i];
    ns += padded * 4;
  }
  TIDE_PLAN_CHECK(ns < limit, "GroupSignature.shapes: the group is too large (", (double)ns,
                  " fp32 bytes unsharded)");
}

void validate_inputs(const GroupSignature& sig, const Topology& topo, const Options& opt) {
  TIDE_PLAN_CHECK(topo.nodes >= 1 && topo.nodes <= kMaxNodes, "Topology.nodes: must be in [1, ",
                  kMaxNodes, "], got ", topo.nodes);
  TIDE_PLAN_CHECK(topo.gpus_per_node >= 1, "Topology.gpus_per_node: must be >= 1, got ",
                  topo.gpus_per_node);
  TIDE_PLAN_CHECK(topo.gpus_per_node <= kMaxGpusPerNode, "Topology.gpus_per_node: L = ",
                  topo.gpus_per_node, " exceeds one NVSwitch domain (L <= ", kMaxGpusPerNode,
                  "); this group falls back to stock FSDP2 collectives");
  validate_signature(sig, topo.world());
  const int L = topo.gpus_per_node;
  TIDE_PLAN_CHECK(opt.struct_size == sizeof(Options), "Options.struct_size: ", opt.struct_size,
                  " does not match this build's ", sizeof(Options));
  // Ranges: see "Option ranges" in tide/plan.h. Each message names the field, its range and the value.
  TIDE_PLAN_CHECK(opt.w_wave >= 0, "Options.w_wave: must be in [0, L=", L, "] (0 = L), got ", opt.w_wave);
  TIDE_PLAN_CHECK(opt.w_wave <= L, "Options.w_wave: W_wave = ", opt.w_wave,
                  " exceeds L = ", L, " (a wave's partials must fit one NVSwitch reduction)");
  TIDE_PLAN_CHECK(opt.k >= 0 && opt.k <= kMaxRoundWidth, "Options.k: must be in [0, ", kMaxRoundWidth,
                  "] (0 = solver; the round widths App. D validates), got ", opt.k);
  TIDE_PLAN_CHECK(opt.n_part >= 0 && opt.n_part <= kMaxPasses, "Options.n_part: must be in [0, ", kMaxPasses,
                  "] (0 = planner, which takes at most ", kMaxAutoPasses, "), got ", opt.n_part);
  TIDE_PLAN_CHECK(opt.n_stg >= 1 && opt.n_stg <= kMaxStagingSlots, "Options.n_stg: must be in [1, ",
                  kMaxStagingSlots, "], got ", opt.n_stg);
  const int b_grad = dtype_size(sig.grad_dtype);
  TIDE_PLAN_CHECK(opt.chunk_bytes == 0 || opt.chunk_bytes >= b_grad, "Options.chunk_bytes: must be 0 (planner) or >= ",
                  b_grad, " (one ", dtype_name(sig.grad_dtype), " gradient element), got ", opt.chunk_bytes);
  TIDE_PLAN_CHECK(opt.sum_ctas >= 0 && opt.sum_ctas <= kMaxCtas, "Options.sum_ctas: must be in [0, ", kMaxCtas,
                  "] (0 = solver), got ", opt.sum_ctas);
  TIDE_PLAN_CHECK(opt.land_ctas >= 0 && opt.land_ctas <= kMaxCtas, "Options.land_ctas: must be in [0, ", kMaxCtas,
                  "] (0 = solver), got ", opt.land_ctas);
  TIDE_PLAN_CHECK(opt.ag_head_bytes >= 0, "Options.ag_head_bytes: must be >= 0 (0 = no head/tail split), got ",
                  opt.ag_head_bytes);
}

int64_t GroupLayout::valid_rows(int p, int r) const {
  const auto& pl = params[p];
  const int64_t first = static_cast<int64_t>(r) * pl.R;
  return std::max<int64_t>(0, std::min<int64_t>(pl.R, pl.D - first));
}

GroupLayout build_layout(const GroupSignature& sig, const Topology& topo) {
  GroupLayout g;
  g.P = static_cast<int>(sig.params.size());
  g.N = topo.world();
  const int b_ag = dtype_size(sig.ag_dtype);
  const int b_grad = dtype_size(sig.grad_dtype);
  int64_t o = 0, o32 = 0;
  for (const auto& ps : sig.params) {
    ParamLayout pl;
    pl.D = ps.shape[0];
    pl.K = 1;
    for (size_t i = 1; i < ps.shape.size(); ++i) pl.K *= ps.shape[i];
    pl.R = (pl.D + g.N - 1) / g.N;
    pl.e = pl.R * pl.K;
    pl.s = pl.e * b_ag;
    pl.o = o;
    pl.o32 = o32;
    o += pl.s;
    o32 += pl.e;
    g.params.push_back(pl);
  }
  g.S = o;
  g.E = o32;
  g.S_fp32 = 4 * o32;
  g.S_grad = static_cast<int64_t>(b_grad) * o32;
  g.B_pack = 4 * static_cast<int64_t>(g.N) * o32;  // Eq. 3: 4 * sum_p N R_p K_p
  return g;
}

}  // namespace tide
