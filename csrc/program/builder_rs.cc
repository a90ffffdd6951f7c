// TIDE-RS program builder (Sections 4-5, Algorithm 1): Level-1 pushes and fp32 sums on the
// "read" stream, Latin-square rail waves on the "rail" stream, landings on the "land" stream.
//
// [Note: RS counters] Every counter has one producing (rank, stream) and counts monotonically
// over calls, so a wait for "the n-th use in call seq" is value + per_call*seq:
//   pushed_from[i]   on owner, by pusher i's push stream: +1 per Level-1 unit (pass, c, chunk)
//   stg_free_from[j] on pusher, by owner j's read stream (CREDIT): +1 per unit consumed
//   ready_from[j]    on every local rank, by local rank j's rail stream: +1 per wave
//   landed_from[l]   on every local rank, by local rank l's land stream: +1 per wave
//   credit_from[t]   on contributor (n, j), by (t, j)'s rail stream (CREDIT): +1 per pass
//   arrival_from[c]  on destination (t, j), by its contributor c's PUT: +1 per pass
//   events (own): read_progress (per (pass, c) summed), sent (per remote block J sent),
//   spare_copied (per pass), rail_done, release (read completion), done (outputs consumable),
//   start (the call reached the caller's stream), pushed (the push stream's last push read).
// [Note: push and sum streams] A rank's Level-1 pushes run on their own stream ("push"), its
// sums on "read" (the caller's stream): the owner's SUM of unit u overlaps the peers' pushes of
// unit u + 1 into the next staging slot, bounded by stg_free credits (§4.1: "device-side counters
// prevent a chunk from being overwritten before the owner finishes reading it"). The push stream
// starts after the caller's stream reached the call (start) and the read completion (release)
// waits for its last push (pushed): both streams read the user's gradients.
// Staging slot and outbox block indices restart every call, so the previous user of a slot
// may lie in the previous call: targets below account for that explicitly.
#include "tide/rs_program.h"

#include <algorithm>
#include <memory>

namespace tide {

namespace {

enum Stream : uint8_t { kRead = 0, kRail = 1, kLandStream = 2 };
constexpr uint8_t kPushLevel2 = 3;  // the push stream's index with Level 2; 1 when direct

struct Ctx {
  const Plan& plan;
  const RsSchedule& rs;
  const GroupLayout& lay;
  RsCallOptions opt;
  int rank, M, L, n, me;
  DType gdt;
  int b;  // grad item size
  int64_t units;  // Level-1 units per call: n_part * M * n_chunks
  int T;          // waves per call
  std::vector<Op>* out;  // ops are appended here (a Program's ops or a generated step)

  // Counter indices.
  int pushed_from(int i) const { return i; }
  int stg_free_from(int j) const { return L + j; }
  int ready_from(int j) const { return 2 * L + j; }
  int landed_from(int l) const { return 3 * L + l; }
  int credit_from(int t) const { return 4 * L + t; }
  int arrival_from(int c) const { return 4 * L + M + c - 1; }
  int ev_progress() const { return 4 * L + 2 * M; }
  int ev_sent() const { return ev_progress() + 1; }
  int ev_rail_done() const { return ev_progress() + 2; }
  int ev_release() const { return ev_progress() + 3; }
  int ev_done() const { return ev_progress() + 4; }
  int ev_spare() const { return ev_progress() + 5; }
  int ev_start() const { return ev_progress() + 6; }
  int ev_pushed() const { return ev_progress() + 7; }
  int num_counters() const { return ev_progress() + 8; }
  uint8_t push_stream() const { return rs.direct ? 1 : kPushLevel2; }

  int rank_of(int node, int local) const { return node * L + local; }

  // Arena offsets.
  int64_t staging_off(int slot, int peer_area) const {
    return slot * rs.stg_slot_bytes +
           static_cast<int64_t>(peer_area) * rs.stg_rows * rs.E_chunk * b;
  }
  int64_t outbox_off(int x) const { return (static_cast<int64_t>(opt.bank) * rs.n_out + x) * rs.block_bytes; }
  int64_t inbox_off(int gen, int s) const { return (static_cast<int64_t>(gen) * L + s) * rs.block_bytes; }
  int64_t spare_off() const { return static_cast<int64_t>(opt.bank) * rs.n_spare * rs.block_bytes; }

  Op& emit(OpKind kind, uint8_t stream, OpTag tag, int32_t round = -1) {
    out->emplace_back();
    Op& op = out->back();
    op.kind = kind;
    op.stream = stream;
    op.tag = tag;
    op.round = round;
    return op;
  }
  void wait(uint8_t stream, OpTag tag, int crank, int idx, int64_t value, int64_t per_call, bool event = false) {
    Op& op = emit(event ? OpKind::kEventWait : OpKind::kWait, stream, tag);
    op.counter = {crank, idx};
    op.value = value;
    op.per_call = per_call;
  }
  void bump(OpKind kind, uint8_t stream, OpTag tag, int crank, int idx) {
    Op& op = emit(kind, stream, tag);
    op.counter = {crank, idx};
    op.value = 1;
  }
  void record(uint8_t stream, OpTag tag, int idx, int64_t value, int64_t per_call) {
    Op& op = emit(OpKind::kEventRecord, stream, tag);
    op.counter = {rank, idx};
    op.value = value;
    op.per_call = per_call;
  }
  BufRef ref(BufKind kind, int owner, int index, int64_t offset, int64_t width, int64_t height = 1,
             int64_t pitch = 0) const {
    BufRef r;
    r.kind = kind; r.rank = owner; r.index = index; r.offset = offset;
    r.width = width; r.height = height; r.pitch = height > 1 ? pitch : 0;
    return r;
  }
  // Valid gradient elements of parameter p in destination rank r's rows (rows past D_p: none).
  int64_t valid_elems(int p, int r) const { return lay.valid_rows(p, r) * lay.params[p].K; }
  // Read order inside a pass (Algorithm 1): the first min(n_out, M-1) remote destinations, then
  // the own-node partial (into the spare), then the remote destinations that wait for sends.
  int first_reads() const { return std::min(rs.n_out, M - 1); }
  int order_of(int c) const { return c == M ? first_reads() : (c <= first_reads() ? c - 1 : c); }
  int c_at(int pos) const { return pos == first_reads() ? M : (pos < first_reads() ? pos + 1 : pos); }
  // Position of (pass, c) in the read order; read_progress counts these.
  int64_t read_pos(int pass, int c) const { return static_cast<int64_t>(pass) * M + order_of(c); }
  int64_t unit_index(int pass, int c, int chunk) const { return read_pos(pass, c) * rs.n_chunks + chunk; }
};

// The previous user of staging slot (u mod n_stg): unit u - n_stg of this call, or the last unit
// of the previous call on the same slot. Returns the stg_free target as (value, per_call).
std::pair<int64_t, int64_t> staging_free_target(const Ctx& x, int64_t u) {
  const int64_t U = x.units, n_stg = x.rs.n_stg;
  if (u >= n_stg) return {u - n_stg + 1 - U, U};
  const int64_t prev = u + n_stg * ((U - 1 - u) / n_stg);  // same slot, previous call
  return {prev + 1 - 2 * U, U};
}

// Level-1 unit (pass, c, chunk), pusher side (push stream): my contribution to every other owner.
void level1_push(Ctx& x, int pass, int c, int chunk, std::vector<RsL1Copy>& mine) {
  const RsSchedule& rs = x.rs;
  const int L = x.L, M = x.M, me = x.me;
  const uint8_t ps = x.push_stream();
  const int64_t u = x.unit_index(pass, c, chunk);
  const int slot = static_cast<int>(u % rs.n_stg);
  const int t = (x.n + c) % M;
  for (int k = 1; k < L; ++k) {  // push steps in rs_push_owner's order (tide/plan.h)
    const int j = rs_push_owner(me, k, L);
    const auto tgt = staging_free_target(x, u);
    x.wait(ps, rs_tag::kStagingWait, x.rank, x.stg_free_from(j), tgt.first, tgt.second);
    Op& op = x.emit(OpKind::kCopy, ps, rs_tag::kPush, static_cast<int32_t>(u));
    const int area = me < j ? me : me - 1;
    const int owner = x.rank_of(x.n, j);
    const int s_j = rs.direct ? 0 : subslice_of(j, c, M, L);
    mine.clear();
    rs_level1_unit_copies(x.lay, rs, x.rank, c, pass, j, chunk, mine);
    for (const RsL1Copy& cp : mine) {
      TIDE_CHECK(cp.s == s_j && cp.t == t && cp.c == c && cp.owner == j, "Level-1 copy order");
      CopyDesc d;
      d.src = x.ref(BufKind::kGrad, x.rank, cp.copy.param, cp.copy.src_offset, cp.copy.width,
                    cp.copy.height, cp.copy.src_pitch);
      d.dst = x.ref(BufKind::kStaging, owner, slot, x.staging_off(slot, area) + cp.copy.dst_offset,
                    cp.copy.width, cp.copy.height, cp.copy.dst_pitch);
      op.copies.push_back(d);
    }
    x.bump(OpKind::kSignal, ps, rs_tag::kPushSignal, owner, x.pushed_from(me));
  }
}

// The SUM terms of one destination row piece: the L-1 staged slices in local-rank order, then
// the own gradient (read in place), all over `v` elements at dst_elem.
void sum_terms(const Ctx& x, Op& op, int slot, int64_t staged_elem, const BufRef& own_src, int64_t dst_elem,
               int64_t v) {
  int term = 0;
  for (int i = 0; i < x.L; ++i) {
    if (i == x.me) continue;
    const int area = i < x.me ? i : i - 1;
    SumTerm st;
    st.src = x.ref(BufKind::kStaging, x.rank, slot, x.staging_off(slot, area) + staged_elem * x.b, v * x.b);
    st.dtype = x.gdt;
    st.dst_elem = dst_elem;
    st.elems = v;
    st.term = term++;
    op.terms.push_back(st);
  }
  SumTerm own;
  own.src = own_src;
  own.dtype = x.gdt;
  own.dst_elem = dst_elem;
  own.elems = v;
  own.term = term;
  op.terms.push_back(own);
}

// Calls f(param, x0, x1, po) for each segment piece of `sub` inside chunk columns
// [col0, col0 + cols): columns [x0, x1) of the span, po the element offset inside the param's shard.
template <typename F>
void for_chunk_pieces(const Ctx& x, const RsSubslice& sub, int64_t col0, int64_t cols, F&& f) {
  for (int si = sub.seg_begin; si < sub.seg_end; ++si) {
    const RsSegment& seg = x.rs.segments[si];
    const int64_t x0 = std::max(col0, seg.sub_offset);
    const int64_t x1 = std::min(col0 + cols, seg.sub_offset + seg.length);
    if (x0 < x1) f(seg.param, x0, x1, seg.param_offset + (x0 - seg.sub_offset));
  }
}

// The owner read its staging slot: credit it back to every pusher.
void credit_slot(Ctx& x) {
  for (int i = 0; i < x.L; ++i)
    if (i != x.me) x.bump(OpKind::kCredit, kRead, rs_tag::kStagingFree, x.rank_of(x.n, i), x.stg_free_from(x.me));
}

// Level-1 unit, owner side (read stream): wait for the L-1 pushes, sum staged contributions in
// local-rank order, then own, into `dst_kind` (outbox block or spare; the output when direct,
// with alpha and accumulate), then credit the slot back to the pushers.
void level1_sum(Ctx& x, int pass, int c, int chunk, BufKind dst_kind, int dst_index, int64_t dst_block_off) {
  const RsSchedule& rs = x.rs;
  const int L = x.L, M = x.M, me = x.me;
  const int64_t u = x.unit_index(pass, c, chunk);
  const int slot = static_cast<int>(u % rs.n_stg);
  const int t = (x.n + c) % M;
  for (int i = 0; i < L; ++i)
    if (i != me) x.wait(kRead, rs_tag::kPushWait, x.rank, x.pushed_from(i), u + 1 - x.units, x.units);
  const int s = rs.direct ? 0 : subslice_of(me, c, M, L);
  const RsSubslice& sub = rs.direct ? rs.subslices[0] : rs.subslice(pass, s);
  const int64_t col0 = chunk * rs.E_chunk;
  const int64_t cols = std::min(rs.E_chunk, rs.E_span - col0);
  if (rs.direct) {  // [Note: direct Level 1]: one SUM per chunk into the output's columns
    const int64_t live = std::min(cols, x.lay.E - col0);
    Op& op = x.emit(OpKind::kSum, kRead, rs_tag::kSum, static_cast<int32_t>(u));
    op.dst = x.ref(BufKind::kOut, x.rank, -1, col0 * 4, live * 4);  // every chunk holds live columns
    op.alpha = x.opt.alpha;
    op.accumulate = x.opt.accumulate;
    for_chunk_pieces(x, sub, col0, cols, [&](int p, int64_t x0, int64_t x1, int64_t po) {
      const int64_t v = std::min(x1 - x0, x.valid_elems(p, x.rank) - po);
      if (v <= 0) return;
      const int64_t own = (static_cast<int64_t>(x.rank) * x.lay.params[p].e + po) * x.b;
      sum_terms(x, op, slot, x0 - col0, x.ref(BufKind::kGrad, x.rank, p, own, v * x.b), x0 - col0, v);
    });
  } else {
    // With one chunk a SUM writes the whole block (1-D, element l*E_sub + col); with several,
    // one SUM per block row covers that row's chunk columns (element col - col0).
    // A row SUM covers only the sub-slice's live columns (a shorter last sub-slice leaves the
    // row's tail unread by every LAND), so its run table stays of the Level-1 shape.
    const bool whole = rs.n_chunks == 1;
    const int64_t live = std::min(cols, sub.length - col0);
    if (!whole && live <= 0) return credit_slot(x);  // a chunk past the live columns: nothing to sum
    std::vector<size_t> sums;  // op indices: emit() may reallocate prog.ops
    for (int l = 0; l < (whole ? 1 : L); ++l) {
      Op& op = x.emit(OpKind::kSum, kRead, rs_tag::kSum, static_cast<int32_t>(u));
      op.dst = whole ? x.ref(dst_kind, x.rank, dst_index, dst_block_off, rs.block_bytes)
                     : x.ref(dst_kind, x.rank, dst_index,
                             dst_block_off + (l * rs.E_sub + col0) * 4, live * 4);
      sums.push_back(x.out->size() - 1);
    }
    for_chunk_pieces(x, sub, col0, cols, [&](int p, int64_t x0, int64_t x1, int64_t po) {
      for (int l = 0; l < L; ++l) {
        const int r = x.rank_of(t, l);
        const int64_t v = std::min(x1 - x0, x.valid_elems(p, r) - po);
        if (v <= 0) continue;
        const int64_t own = (static_cast<int64_t>(r) * x.lay.params[p].e + po) * x.b;
        sum_terms(x, (*x.out)[sums[whole ? 0 : l]], slot, l * rs.E_chunk + x0 - col0,
                  x.ref(BufKind::kGrad, x.rank, p, own, v * x.b), whole ? l * rs.E_sub + x0 : x0 - col0, v);
      }
    });
  }
  credit_slot(x);
}

}  // namespace

float rs_fold_alpha(RsReduceOp op, int world, double premul, double predivide, double postdivide) {
  TIDE_PLAN_CHECK(world >= 1, "world: must be >= 1, got ", world);
  TIDE_PLAN_CHECK(predivide > 0 && postdivide > 0, "divide factors must be > 0, got ", predivide,
                  " and ", postdivide);
  double a = 1.0 / (predivide * postdivide);
  if (op == RsReduceOp::kAvg) a /= world;
  if (op == RsReduceOp::kPremulSum) a *= premul;
  return static_cast<float>(a);
}

RsProgramGenerator::RsProgramGenerator(std::shared_ptr<const Plan> plan, const RsCallOptions& opt)
    : plan_(std::move(plan)), opt_(opt) {
  TIDE_PLAN_CHECK(opt.struct_size == sizeof(RsCallOptions), "RsCallOptions.struct_size: ",
                  opt.struct_size, " does not match this build's ", sizeof(RsCallOptions));
  TIDE_PLAN_CHECK(opt.bank == 0 || opt.bank == 1, "RsCallOptions.bank: must be 0 or 1, got ", opt.bank);
  TIDE_PLAN_CHECK(plan_->sig.grad_dtype == DType::kBF16 || plan_->sig.grad_dtype == DType::kFP16 ||
                      plan_->sig.grad_dtype == DType::kFP32,
                  "GroupSignature.grad_dtype: TIDE-RS reduces bfloat16, float16 or float32 gradients, got ",
                  dtype_name(plan_->sig.grad_dtype));
}

namespace {
Ctx make_ctx(const Plan& plan, const RsCallOptions& opt, int rank, std::vector<Op>* out) {
  TIDE_PLAN_CHECK(rank >= 0 && rank < plan.topo.world(), "rank: ", rank, " is outside [0, ",
                  plan.topo.world(), ")");
  Ctx x{plan, plan.rs, plan.layout, opt, rank, plan.topo.nodes, plan.topo.gpus_per_node,
        rank / plan.topo.gpus_per_node, rank % plan.topo.gpus_per_node, plan.sig.grad_dtype,
        dtype_size(plan.sig.grad_dtype), 0, 0, out};
  x.units = static_cast<int64_t>(plan.rs.n_part) * x.M * plan.rs.n_chunks;
  x.T = static_cast<int>(plan.rs.wave_list.size());
  return x;
}
}  // namespace

Program RsProgramGenerator::header(int rank, bool counter_names) const {
  const Plan& plan = *plan_;
  const RsCallOptions& opt = opt_;
  Program prog;
  Ctx x = make_ctx(plan, opt, rank, &prog.ops);
  const int M = x.M, L = x.L;
  prog.collective = Collective::kReduceScatter;
  prog.rank = rank;
  prog.topo = plan.topo;
  prog.plan_hash = plan.hash;
  prog.group = opt.group;
  // [Note: push and sum streams]; a direct schedule has no rail or land stream.
  prog.streams = plan.rs.direct ? std::vector<std::string>{"read", "push"}
                                : std::vector<std::string>{"read", "rail", "land", "push"};
  prog.sum_ctas = plan.solver.sum_ctas;    // C_sum, Eq. 13
  prog.land_ctas = plan.solver.land_ctas;  // C_mc, Eq. 14
  prog.num_counters = x.num_counters();
  prog.release_event = x.ev_release();
  prog.done_event = x.ev_done();
  prog.arena = arena_spec_for(plan, prog.num_counters);
  prog.counter_names.resize(counter_names ? prog.num_counters : 0);
  for (int i = 0; i < L && counter_names; ++i) {
    prog.counter_names[x.pushed_from(i)] = TIDE_STR_CAT("pushed_from[", i, "]");
    prog.counter_names[x.stg_free_from(i)] = TIDE_STR_CAT("stg_free_from[", i, "]");
    prog.counter_names[x.ready_from(i)] = TIDE_STR_CAT("ready_from[", i, "]");
    prog.counter_names[x.landed_from(i)] = TIDE_STR_CAT("landed_from[", i, "]");
  }
  if (counter_names) {
    for (int t = 0; t < M; ++t) prog.counter_names[x.credit_from(t)] = TIDE_STR_CAT("credit_from[", t, "]");
    for (int c = 1; c < M; ++c) prog.counter_names[x.arrival_from(c)] = TIDE_STR_CAT("arrival_from[", c, "]");
    prog.counter_names[x.ev_progress()] = "read_progress";
    prog.counter_names[x.ev_sent()] = "sent";
    prog.counter_names[x.ev_rail_done()] = "rail_done";
    prog.counter_names[x.ev_release()] = "release";
    prog.counter_names[x.ev_done()] = "done";
    prog.counter_names[x.ev_spare()] = "spare_copied";
    prog.counter_names[x.ev_start()] = "start";
    prog.counter_names[x.ev_pushed()] = "pushed";
  }
  const RsArenaNeeds need = rs_arena_needs(plan);
  const auto region = [&](BufKind k) { return prog.arena.bytes[static_cast<int>(k)]; };
  TIDE_CHECK(region(BufKind::kStaging) >= need.staging && region(BufKind::kOutbox) >= need.outbox &&
                 region(BufKind::kInbox) >= need.inbox && region(BufKind::kSpare) >= need.spare,
             "arena RS regions (staging ", region(BufKind::kStaging), ", outbox ",
             region(BufKind::kOutbox), ", inbox ", region(BufKind::kInbox), ", spare ",
             region(BufKind::kSpare), ") are smaller than the RS program needs (", need.staging,
             ", ", need.outbox, ", ", need.inbox, ", ", need.spare, ")");

  const int P = x.lay.P;
  prog.user_buffer_bytes[static_cast<int>(BufKind::kGrad)].assign(P + 1, 0);
  for (int p = 0; p < P; ++p) {
    const int64_t bytes = x.lay.params[p].D * x.lay.params[p].K * x.b;
    prog.user_buffer_bytes[static_cast<int>(BufKind::kGrad)][p + 1] = bytes;
    prog.user_inputs.push_back(x.ref(BufKind::kGrad, rank, p, 0, bytes));
  }
  prog.user_buffer_bytes[static_cast<int>(BufKind::kOut)] = {x.lay.E * 4};
  prog.user_outputs.push_back(x.ref(BufKind::kOut, rank, -1, 0, x.lay.E * 4));
  return prog;
}

int RsProgramGenerator::steps(int, int stream) const {
  const RsSchedule& rs = plan_->rs;
  const int T = static_cast<int>(rs.wave_list.size());
  // read and push: start, one step per (pass, position), release / pushed; rail/land: one step
  // per wave, final record. Direct: read and push only, one step for all chunks.
  const int units = rs.direct ? 1 : rs.n_part * rs.M;
  if (stream == kRead || stream == (rs.direct ? 1 : kPushLevel2)) return units + 2;
  return !rs.direct && (stream == kRail || stream == kLandStream) ? T + 1 : 0;
}

void RsProgramGenerator::emit(int rank, int stream, int step, std::vector<Op>& out) const {
  const Plan& plan = *plan_;
  const RsCallOptions& opt = opt_;
  const RsSchedule& rs = plan.rs;
  Ctx x = make_ctx(plan, opt, rank, &out);
  const int M = x.M, L = x.L, n = x.n, me = x.me, T = x.T;
  const int64_t PM = static_cast<int64_t>(rs.n_part) * M;
  const int64_t D = rs.d_rem;
  TIDE_CHECK(step >= 0 && step < steps(rank, stream), "RsProgramGenerator::emit: rank ", rank, " stream ",
             stream, " has no step ", step);
  const int last = rs.direct ? 2 : static_cast<int>(PM) + 1;
  std::vector<RsL1Copy> mine;
  if (stream == x.push_stream()) {
    // ---- push stream: Level-1 pushes ([Note: push and sum streams]) ------------------------
    const uint8_t ps = x.push_stream();
    if (step == 0) {  // the caller's stream reached this call: its gradients are written
      x.wait(ps, rs_tag::kPushStart, rank, x.ev_start(), 0, 1, true);
      return;
    }
    if (step == last) {
      x.record(ps, rs_tag::kPushed, x.ev_pushed(), 0, 1);
      return;
    }
    const int pass = rs.direct ? 0 : (step - 1) / M;
    const int c = rs.direct ? M : x.c_at((step - 1) % M);
    for (int chunk = 0; chunk < rs.n_chunks; ++chunk) level1_push(x, pass, c, chunk, mine);
    return;
  }
  if (stream == kRead) {
    // ---- read stream: Level 1 (Algorithm 1 lines 1-7; later sums follow the sends) --------
    if (step == 0) {
      x.record(kRead, rs_tag::kPushStart, x.ev_start(), 0, 1);
      // bank b was last used by call e-2: its sends and spare copies must be done
      if (!rs.direct) x.wait(kRead, rs_tag::kBankWait, rank, x.ev_rail_done(), -2, 1, true);
      return;
    }
    if (step == last) {
      x.wait(kRead, rs_tag::kPushed, rank, x.ev_pushed(), 0, 1, true);
      x.record(kRead, OpTag::kRelease, x.ev_release(), 0, 1);
      if (rs.direct) x.record(kRead, OpTag::kComplete, x.ev_done(), 0, 1);
      return;
    }
    if (rs.direct) {  // [Note: direct Level 1]
      for (int chunk = 0; chunk < rs.n_chunks; ++chunk) level1_sum(x, 0, M, chunk, BufKind::kOut, -1, 0);
      return;
    }
    const int pass = (step - 1) / M, pos = (step - 1) % M;
    const int c = x.c_at(pos);
    BufKind kind = BufKind::kSpare;
    int index = opt.bank;
    int64_t off = x.spare_off();
    if (c == M && pass > 0)  // one spare per bank: the previous pass's own partial is copied out
      x.wait(kRead, rs_tag::kSpareWait, rank, x.ev_spare(), pass - rs.n_part, rs.n_part, true);
    if (c < M) {
      const int64_t J = static_cast<int64_t>(pass) * (M - 1) + c - 1;
      index = static_cast<int>(J % rs.n_out);
      kind = BufKind::kOutbox;
      off = x.outbox_off(index);
      if (J >= rs.n_out)  // partial outbox: block J mod n_out is free once J - n_out is sent
        x.wait(kRead, rs_tag::kOutboxWait, rank, x.ev_sent(), J - rs.n_out + 1 - D, D, true);
    }
    for (int chunk = 0; chunk < rs.n_chunks; ++chunk) level1_sum(x, pass, c, chunk, kind, index, off);
    x.record(kRead, rs_tag::kProgress, x.ev_progress(), x.read_pos(pass, c) + 1 - PM, PM);
    return;
  }
  if (stream == kRail) {
    // ---- rail stream: Level 2 waves (Algorithm 1 lines 8-17) ------------------------------
    if (step == T) {
      x.record(kRail, rs_tag::kRailDone, x.ev_rail_done(), 0, 1);
      return;
    }
    const int g = step;
    const RsWave& w = rs.wave_list[g];
    const int q = w.gen, pass = w.pass;
    // Generation q is free once the previous wave on it landed on every local GPU. For the first
    // waves of a call that wave is in the previous call (with an odd T not at g - n_par + T, as
    // generations restart at 0), so they wait for all of the previous call's landings.
    const int64_t gen_free = g >= rs.n_par ? g - rs.n_par + 1 - T : -T;
    for (int l = 0; l < L; ++l)
      x.wait(kRail, rs_tag::kGenWait, rank, x.landed_from(l), gen_free, T);
    for (int s = 0; s < L; ++s)
      if (w.zero_mask[me] >> s & 1) {
        Op& z = x.emit(OpKind::kZero, kRail, rs_tag::kZero, g);
        z.dst = x.ref(BufKind::kInbox, rank, q, x.inbox_off(q, s), rs.block_bytes);
      }
    for (int c = w.c_begin; c < std::min(w.c_end, M); ++c)
      x.bump(OpKind::kCredit, kRail, rs_tag::kInboxCredit, x.rank_of(((n - c) % M + M) % M, me),
             x.credit_from(n));
    for (int ri = w.round_begin; ri < w.round_end; ++ri) {
      const RsRound& rd = rs.rounds[ri];
      for (int c = rd.c_begin; c < rd.c_end; ++c) {
        const int t = (n + c) % M;
        const int64_t J = static_cast<int64_t>(pass) * (M - 1) + c - 1;
        x.wait(kRail, rs_tag::kSumWait, rank, x.ev_progress(), x.read_pos(pass, c) + 1 - PM, PM, true);
        x.wait(kRail, OpTag::kCreditWait, rank, x.credit_from(t), pass + 1 - rs.n_part, rs.n_part);
        Op& put = x.emit(OpKind::kPut, kRail, rs_tag::kPut, ri);
        const int dest = x.rank_of(t, me);
        CopyDesc d;
        d.src = x.ref(BufKind::kOutbox, rank, static_cast<int>(J % rs.n_out),
                      x.outbox_off(static_cast<int>(J % rs.n_out)), rs.block_bytes);
        const int s = subslice_of(me, c, M, L);
        d.dst = x.ref(BufKind::kInbox, dest, q, x.inbox_off(q, s), rs.block_bytes);
        put.copies.push_back(d);
        put.counter = {dest, x.arrival_from(c)};
        put.value = 1;
        x.record(kRail, rs_tag::kSent, x.ev_sent(), J + 1 - D, D);
      }
      for (int c = rd.c_begin; c < rd.c_end; ++c)
        x.wait(kRail, OpTag::kArrivalWait, rank, x.arrival_from(c), pass + 1 - rs.n_part, rs.n_part);
    }
    if (w.own) {
      x.wait(kRail, rs_tag::kSumWait, rank, x.ev_progress(), x.read_pos(pass, M) + 1 - PM, PM, true);
      Op& cp = x.emit(OpKind::kCopy, kRail, rs_tag::kSpareCopy, g);
      CopyDesc d;
      d.src = x.ref(BufKind::kSpare, rank, opt.bank, x.spare_off(), rs.block_bytes);
      d.dst = x.ref(BufKind::kInbox, rank, q, x.inbox_off(q, me), rs.block_bytes);
      cp.copies.push_back(d);
      x.record(kRail, rs_tag::kSpareCopy, x.ev_spare(), pass + 1 - rs.n_part, rs.n_part);
    }
    for (int l = 0; l < L; ++l)
      x.bump(OpKind::kSignal, kRail, rs_tag::kReady, x.rank_of(n, l), x.ready_from(me));
    return;
  }
  // ---- land stream: one landing per wave and sub-slice ----------------------------------
  if (step == T) {
    x.record(kLandStream, OpTag::kComplete, x.ev_done(), 0, 1);
    return;
  }
  const int g = step;
  const RsWave& w = rs.wave_list[g];
  const int q = w.gen;
  for (int j = 0; j < L; ++j)
    x.wait(kLandStream, rs_tag::kReadyWait, rank, x.ready_from(j), g + 1 - T, T);
  for (int s = 0; s < L; ++s) {
    const RsSubslice& sub = rs.subslice(w.pass, s);
    if (sub.length == 0) continue;
    Op& land = x.emit(OpKind::kLand, kLandStream, rs_tag::kLand, g);
    land.dst = x.ref(BufKind::kOut, rank, -1, sub.out_begin * 4, sub.length * 4);
    land.alpha = opt.alpha;
    land.accumulate = opt.accumulate || w.w > 0;
    for (int j = 0; j < L; ++j) {
      SumTerm st;
      st.src = x.ref(BufKind::kInbox, x.rank_of(n, j), q,
                     x.inbox_off(q, s) + static_cast<int64_t>(me) * rs.E_sub * 4, sub.length * 4);
      st.dtype = DType::kFP32;
      st.dst_elem = 0;
      st.elems = sub.length;
      st.term = j;
      land.terms.push_back(st);
    }
  }
  for (int l = 0; l < L; ++l)
    x.bump(OpKind::kSignal, kLandStream, rs_tag::kLanded, x.rank_of(n, l), x.landed_from(me));
}

int RsProgramGenerator::producer(const CounterRef& c, int* stream) const {
  const Plan& plan = *plan_;
  *stream = -1;
  if (c.rank < 0 || c.rank >= plan.topo.world()) return -1;
  std::vector<Op> none;
  const Ctx x = make_ctx(plan, opt_, c.rank, &none);
  const int L = x.L, M = x.M, n = x.n, me = x.me, i = c.index;
  if (i < 0 || i >= x.num_counters()) return -1;
  const auto at = [&](int node, int local, int s) { *stream = s; return x.rank_of(node, local); };
  const bool direct = x.rs.direct;
  if (i < L) return at(n, i, x.push_stream());                            // pushed_from[i]
  if (i < 2 * L) return at(n, i - L, kRead);                              // stg_free_from[j]
  if (i == x.ev_progress() || i == x.ev_release() || i == x.ev_start()) return at(n, me, kRead);
  if (i == x.ev_pushed()) return at(n, me, x.push_stream());
  if (i == x.ev_done()) return at(n, me, direct ? kRead : kLandStream);
  if (direct) return -1;                                                  // no Level-2 counters
  if (i < 3 * L) return at(n, i - 2 * L, kRail);                          // ready_from[j]
  if (i < 4 * L) return at(n, i - 3 * L, kLandStream);                    // landed_from[l]
  if (i < 4 * L + M) return at(i - 4 * L, me, kRail);                     // credit_from[t]
  if (i < x.ev_progress()) {  // arrival_from[c]: the PUT of contributor node n - c
    const int cc = i - 4 * L - M + 1;
    return cc < M ? at(((n - cc) % M + M) % M, me, kRail) : -1;
  }
  return at(n, me, kRail);  // sent, rail_done, spare_copied
}

Program build_rs_program(const Plan& plan, const RsCallOptions& opt, int rank) {
  // A non-owning handle: the generator lives only inside this call.
  const RsProgramGenerator generator(std::shared_ptr<const Plan>(std::shared_ptr<const Plan>(), &plan), opt);
  Program prog = generator.header(rank);
  Ctx x = make_ctx(plan, opt, rank, &prog.ops);
  const int P = x.lay.P;
  // Eq. 5 provenance: every valid element of out[p, r] is the sum over ranks u of grad_u[p] rows
  // I_{p,r}; padded rows are zero. (alpha scales values, not provenance; accumulate adds the
  // previous output, which the checker cannot name, so no expects then.)
  if (!opt.accumulate) {
    for (int p = 0; p < P; ++p) {
      const ParamLayout& pl = x.lay.params[p];
      const int64_t v = x.valid_elems(p, rank);
      if (v > 0) {
        Expect e;
        e.region = x.ref(BufKind::kOut, rank, -1, pl.o32 * 4, v * 4);
        e.region_dtype = DType::kFP32;
        for (int u = 0; u < plan.topo.world(); ++u)
          e.sources.push_back({x.ref(BufKind::kGrad, u, p, rank * pl.e * x.b, v * x.b), x.gdt});
        prog.expects.push_back(e);
      }
      if (v < pl.e) {
        Expect e;
        e.region = x.ref(BufKind::kOut, rank, -1, (pl.o32 + std::max<int64_t>(v, 0)) * 4,
                         (pl.e - std::max<int64_t>(v, 0)) * 4);
        e.region_dtype = DType::kFP32;
        prog.expects.push_back(e);
      }
    }
  }

  for (int stream = 0; stream < static_cast<int>(prog.streams.size()); ++stream)
    for (int step = 0, n = generator.steps(rank, stream); step < n; ++step) generator.emit(rank, stream, step, prog.ops);
  return prog;
}

std::vector<Program> build_rs_programs(const Plan& plan, const RsCallOptions& opt) {
  std::vector<Program> out;
  out.reserve(plan.topo.world());
  for (int r = 0; r < plan.topo.world(); ++r)
    out.push_back(opt.expert_lane ? build_rs_expert_program(plan, opt, r) : build_rs_program(plan, opt, r));
  return out;
}

RsProgramStats rs_program_stats(const Program& prog) {
  RsProgramStats st;
  for (const Op& op : prog.ops) {
    ++st.ops;
    if (op.tag == rs_tag::kPush) st.l1_descriptors += static_cast<int64_t>(op.copies.size());
    st.puts += op.kind == OpKind::kPut;
    st.sums += op.kind == OpKind::kSum;
    st.lands += op.kind == OpKind::kLand;
    st.zeros += op.kind == OpKind::kZero;
  }
  return st;
}

RsArenaNeeds rs_arena_needs(const Plan& plan) {
  const RsSchedule& rs = plan.rs;
  RsArenaNeeds a;
  a.staging = rs.n_stg * rs.stg_slot_bytes;
  a.outbox = 2 * static_cast<int64_t>(rs.n_out) * rs.block_bytes;
  a.inbox = static_cast<int64_t>(rs.n_par) * rs.L * rs.block_bytes;
  a.spare = 2 * static_cast<int64_t>(rs.n_spare) * rs.block_bytes;
  return a;
}

}  // namespace tide
