// TIDE-RS expert lane (App. F): routed-expert subgroups with L_sub = 1 rank per node have M rail
// peers and no local peers, so Level 1 and the Latin square have nothing to do. Each rank sends
// its bf16 (grad dtype) rows for every destination straight from the gradient over its rail,
// split into four parts (one per RMA context), into a double-buffered inbox of
// kExpertSlots = 7 slots per generation; the destination folds each wave with a fixed
// eight-source fp32 sum (its own contribution or the running output, plus up to 7 arrivals).
//
// Counters (single producer each): credit_from[t] on a contributor, by destination t's rail
// stream (+1 per call); arrival_from[c] on a destination, by contributor c's PUTs (+parts per
// call); events: arrived (rail, per wave), landed (land, per wave), sent (rail, per call),
// release, done.
#include <algorithm>

#include "tide/rs_program.h"

namespace tide {

namespace {

enum Stream : uint8_t { kRail = 0, kLandStream = 1 };

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

struct Lane {
  int M, n, W;
  int64_t slot_bytes;
  int credit_from(int t) const { return t; }
  int arrival_from(int c) const { return M + c - 1; }
  int ev_arrived() const { return 2 * M; }
  int ev_landed() const { return 2 * M + 1; }
  int ev_sent() const { return 2 * M + 2; }
  int ev_release() const { return 2 * M + 3; }
  int ev_done() const { return 2 * M + 4; }
  int num_counters() const { return 2 * M + 5; }
  int wave_of(int c) const { return (c - 1) / kExpertSlots; }
  int slot_of(int c) const { return (c - 1) % kExpertSlots; }
  int64_t inbox_off(int gen, int slot) const { return (static_cast<int64_t>(gen) * kExpertSlots + slot) * slot_bytes; }
};

BufRef ref(BufKind kind, int rank, int index, int64_t offset, int64_t width) {
  BufRef r;
  r.kind = kind; r.rank = rank; r.index = index; r.offset = offset; r.width = width;
  return r;
}

Op& emit(Program& prog, OpKind kind, uint8_t stream, OpTag tag, int32_t round = -1) {
  prog.ops.emplace_back();
  Op& op = prog.ops.back();
  op.kind = kind; op.stream = stream; op.tag = tag; op.round = round;
  return op;
}

void counter_op(Program& prog, OpKind kind, uint8_t stream, OpTag tag, int crank, int idx,
                int64_t value, int64_t per_call) {
  Op& op = emit(prog, kind, stream, tag);
  op.counter = {crank, idx};
  op.value = value;
  op.per_call = per_call;
}

}  // namespace

int64_t rs_expert_inbox_bytes(const Plan& plan) {
  const int64_t slot = align_up(plan.layout.E * dtype_size(plan.sig.grad_dtype), 16);
  return 2 * kExpertSlots * slot;
}

Program build_rs_expert_program(const Plan& plan, const RsCallOptions& opt, int rank) {
  TIDE_PLAN_CHECK(plan.topo.gpus_per_node == 1, "RsCallOptions.expert_lane: the expert lane is "
                  "for subgroups with one rank per node (L_sub = 1), this plan has L = ",
                  plan.topo.gpus_per_node);
  const GroupLayout& lay = plan.layout;
  const int M = plan.topo.nodes;
  const DType gdt = plan.sig.grad_dtype;
  const int b = dtype_size(gdt);
  Lane x{M, rank, std::max(1, (M - 1 + kExpertSlots - 1) / kExpertSlots),
         align_up(lay.E * b, 16)};
  const int W = x.W, n = rank;
  Program prog;
  prog.collective = Collective::kReduceScatter;
  prog.rank = rank;
  prog.topo = plan.topo;
  prog.plan_hash = plan.hash;
  prog.group = opt.group;
  prog.streams = {"rail", "land"};
  prog.sum_ctas = plan.solver.sum_ctas;    // C_sum, Eq. 13
  prog.land_ctas = plan.solver.land_ctas;  // C_mc, Eq. 14
  prog.num_counters = x.num_counters();
  prog.counter_names.resize(prog.num_counters);
  for (int t = 0; t < M; ++t) prog.counter_names[x.credit_from(t)] = TIDE_STR_CAT("credit_from[", t, "]");
  for (int c = 1; c < M; ++c) prog.counter_names[x.arrival_from(c)] = TIDE_STR_CAT("arrival_from[", c, "]");
  prog.counter_names[x.ev_arrived()] = "arrived";
  prog.counter_names[x.ev_landed()] = "landed";
  prog.counter_names[x.ev_sent()] = "sent";
  prog.counter_names[x.ev_release()] = "release";
  prog.counter_names[x.ev_done()] = "done";
  prog.release_event = x.ev_release();
  prog.done_event = x.ev_done();
  // The lane's arena: the double-buffered inbox and the counters (the planner's memory model
  // does not size the lane yet, so the program carries its own layout).
  ArenaSpec& a = prog.arena;
  a.offset[static_cast<int>(BufKind::kInbox)] = 0;
  a.bytes[static_cast<int>(BufKind::kInbox)] = rs_expert_inbox_bytes(plan);
  a.counters_offset = align_up(a.bytes[static_cast<int>(BufKind::kInbox)], 4096);
  a.counters_bytes = align_up(8ll * prog.num_counters, 4096);
  a.total = a.counters_offset + a.counters_bytes;

  const int P = lay.P;
  prog.user_buffer_bytes[static_cast<int>(BufKind::kGrad)].assign(P + 1, 0);
  for (int p = 0; p < P; ++p) {
    const int64_t bytes = lay.params[p].D * lay.params[p].K * b;
    prog.user_buffer_bytes[static_cast<int>(BufKind::kGrad)][p + 1] = bytes;
    prog.user_inputs.push_back(ref(BufKind::kGrad, rank, p, 0, bytes));
  }
  prog.user_buffer_bytes[static_cast<int>(BufKind::kOut)] = {lay.E * 4};
  prog.user_outputs.push_back(ref(BufKind::kOut, rank, -1, 0, lay.E * 4));
  auto valid = [&](int p, int r) { return lay.valid_rows(p, r) * lay.params[p].K; };
  if (!opt.accumulate) {
    for (int p = 0; p < P; ++p) {
      const ParamLayout& pl = lay.params[p];
      const int64_t v = std::max<int64_t>(0, valid(p, rank));
      if (v > 0) {
        Expect e;
        e.region = ref(BufKind::kOut, rank, -1, pl.o32 * 4, v * 4);
        e.region_dtype = DType::kFP32;
        for (int u = 0; u < M; ++u) e.sources.push_back({ref(BufKind::kGrad, u, p, rank * pl.e * b, v * b), gdt});
        prog.expects.push_back(e);
      }
      if (v < pl.e) {
        Expect e;
        e.region = ref(BufKind::kOut, rank, -1, (pl.o32 + v) * 4, (pl.e - v) * 4);
        e.region_dtype = DType::kFP32;
        prog.expects.push_back(e);
      }
    }
  }

  // ---- rail stream: per wave, free the generation, credit, send, collect ------------------
  for (int w = 0; w < W; ++w) {
    const int q = w % 2;
    const int c0 = w * kExpertSlots + 1, c1 = std::min(M, c0 + kExpertSlots);
    // Generation q is free once this rank landed wave w-2 (for the first two waves: the
    // previous call's landings).
    counter_op(prog, OpKind::kEventWait, kRail, rs_tag::kGenWait, rank, x.ev_landed(),
               w >= 2 ? w - 2 + 1 - W : -W, W);
    for (int c = c0; c < c1; ++c)
      counter_op(prog, OpKind::kCredit, kRail, rs_tag::kInboxCredit, ((n - c) % M + M) % M,
                 x.credit_from(n), 1, 0);
    for (int c = c0; c < c1; ++c) {
      const int t = (n + c) % M;
      counter_op(prog, OpKind::kWait, kRail, OpTag::kCreditWait, rank, x.credit_from(t), 0, 1);
      // Destination t's rows of every parameter, split into kExpertRailParts parts.
      std::vector<CopyDesc> pieces[kExpertRailParts];
      for (int p = 0; p < P; ++p) {
        const ParamLayout& pl = lay.params[p];
        const int64_t v = valid(p, t);
        if (v <= 0) continue;
        const int64_t part = align_up((v + kExpertRailParts - 1) / kExpertRailParts, kSubsliceAlignElems);
        for (int i = 0; i < kExpertRailParts && i * part < v; ++i) {
          const int64_t len = std::min(part, v - i * part);
          CopyDesc d;
          d.src = ref(BufKind::kGrad, rank, p, (t * pl.e + i * part) * b, len * b);
          d.dst = ref(BufKind::kInbox, t, q, x.inbox_off(q, x.slot_of(c)) + (pl.o32 + i * part) * b, len * b);
          pieces[i].push_back(d);
        }
      }
      for (int i = 0; i < kExpertRailParts; ++i) {
        Op& put = emit(prog, OpKind::kPut, kRail, rs_tag::kPut, w);
        put.copies = pieces[i];
        put.counter = {t, x.arrival_from(c)};
        put.value = 1;
      }
    }
    for (int c = c0; c < c1; ++c)
      counter_op(prog, OpKind::kWait, kRail, OpTag::kArrivalWait, rank, x.arrival_from(c), 0,
                 kExpertRailParts);
    counter_op(prog, OpKind::kEventRecord, kRail, rs_tag::kReady, rank, x.ev_arrived(), w + 1 - W, W);
  }
  counter_op(prog, OpKind::kEventRecord, kRail, rs_tag::kSent, rank, x.ev_sent(), 0, 1);

  // ---- land stream: fixed eight-source fp32 sum per wave ----------------------------------
  for (int w = 0; w < W; ++w) {
    const int q = w % 2;
    const int c0 = w * kExpertSlots + 1, c1 = std::min(M, c0 + kExpertSlots);
    counter_op(prog, OpKind::kEventWait, kLandStream, rs_tag::kReadyWait, rank, x.ev_arrived(), w + 1 - W, W);
    Op& land = emit(prog, OpKind::kLand, kLandStream, rs_tag::kLand, w);
    land.dst = ref(BufKind::kOut, rank, -1, 0, lay.E * 4);
    land.alpha = opt.alpha;
    land.accumulate = opt.accumulate || w > 0;
    for (int p = 0; p < P; ++p) {
      const ParamLayout& pl = lay.params[p];
      const int64_t v = valid(p, rank);
      if (v <= 0) continue;
      if (w == 0) {  // source 0: the own contribution, read in place
        SumTerm own;
        own.src = ref(BufKind::kGrad, rank, p, rank * pl.e * b, v * b);
        own.dtype = gdt; own.dst_elem = pl.o32; own.elems = v; own.term = 0;
        land.terms.push_back(own);
      }
      for (int c = c0; c < c1; ++c) {
        SumTerm st;
        st.src = ref(BufKind::kInbox, rank, q, x.inbox_off(q, x.slot_of(c)) + pl.o32 * b, v * b);
        st.dtype = gdt; st.dst_elem = pl.o32; st.elems = v; st.term = 1 + x.slot_of(c);
        land.terms.push_back(st);
      }
    }
    counter_op(prog, OpKind::kEventRecord, kLandStream, rs_tag::kLanded, rank, x.ev_landed(), w + 1 - W, W);
  }
  counter_op(prog, OpKind::kEventWait, kLandStream, rs_tag::kRailDone, rank, x.ev_sent(), 0, 1);
  counter_op(prog, OpKind::kEventRecord, kLandStream, OpTag::kRelease, rank, x.ev_release(), 0, 1);
  counter_op(prog, OpKind::kEventRecord, kLandStream, OpTag::kComplete, rank, x.ev_done(), 0, 1);
  return prog;
}

}  // namespace tide
