// TIDE-AG programs (Section 3): local push, paced Bruck rounds over rail l, strided scatters of
// received stage slots into all L local landings, per-area credits, decoupled streams; the
// expert lane (L_sub = 1: recursive doubling landing to landing, no stage); and the pull landing
// into the rank's own user buffers, on one node ([Note: pull landing]) and across nodes, where the
// rounds stay and the scatters become pulls ([Note: pull landing across nodes]); the pull programs
// lay out an arena of their stage and counters only ([Note: pulled arena] in tide/plan.h).
//
// [Note: AG streams and counters] Rank r = (n, l), call seq e:
//   caller      [CAST own shard -> stage slot 0]; wait READY[*] >= e; local push (own shard into
//               all L landings); record PUSHED; per round d: wait CREDIT[d] >= e-1 (the target's
//               area d is free from call e-1), wait PACE[d] >= e (d >= 1), PUT head, PUT tail,
//               then wait own HEAD[d] >= e, confirm to the round-(d+1) sender (PACE[d+1]), wait
//               own TAIL[d] >= e; record SENDS (= release: own shard no longer read).
//   readiness   wait DONE-event >= e-1 (landing consumed), SIGNAL READY[l] on every local rank.
//   scatter     wait READY[*] >= e; per round: wait TAIL[d] >= e, strided scatters into all L
//               landings; record SCATTERED; wait SENDS >= e (area d is also forwarded by our own
//               later rounds), then CREDIT[d] to each round-d sender.
//   completion  wait PUSHED, SCATTERED; SIGNAL DONE[l] on every local rank; wait DONE[*] >= e
//               (node-wide completion fence); record DONE (the event the framework waits on).
// Every counter has one producing (rank, stream), see program.h.
//
// [Note: credit placement] The paper's caller stream flushes call e's credits at the start of
// call e+1; here the scatter stream emits them as soon as call e's scatters and forwarding sends
// are done. Both release area d only after its last reader, and both let the next call's credit
// depend on this rank's previous scatter alone, never on the node-wide completion fence.
// [Note: pacing is not safety] PACE waits throttle rail incast; dropping one changes timing,
// not bytes, so the checker (which proves I1-I4) does not flag it.
#include <algorithm>
#include <cstdint>

#include "tide/program.h"

namespace tide {

namespace {

enum Stream : uint8_t { kCaller = 0, kReadiness = 1, kScatterStream = 2, kCompletion = 3 };

struct AgCounters {
  int L = 0, R = 0;
  int ready(int l) const { return l; }
  int done(int l) const { return L + l; }
  int head(int d) const { return 2 * L + d; }
  int tail(int d) const { return 2 * L + R + d; }
  int pace(int d) const { return 2 * L + 2 * R + d; }
  int credit(int d) const { return 2 * L + 3 * R + d; }
  int ev_pushed() const { return 2 * L + 4 * R; }
  int ev_sends() const { return ev_pushed() + 1; }
  int ev_scattered() const { return ev_pushed() + 2; }
  int ev_done() const { return ev_pushed() + 3; }
  int count() const { return ev_pushed() + 4; }
  std::vector<std::string> names() const {
    std::vector<std::string> v(count());
    for (int l = 0; l < L; ++l) v[ready(l)] = TIDE_STR_CAT("READY[", l, "]");
    for (int l = 0; l < L; ++l) v[done(l)] = TIDE_STR_CAT("DONE[", l, "]");
    for (int d = 0; d < R; ++d) {
      v[head(d)] = TIDE_STR_CAT("HEAD[", d, "]");
      v[tail(d)] = TIDE_STR_CAT("TAIL[", d, "]");
      v[pace(d)] = TIDE_STR_CAT("PACE[", d, "]");
      v[credit(d)] = TIDE_STR_CAT("CREDIT[", d, "]");
    }
    v[ev_pushed()] = "ev:pushed";
    v[ev_sends()] = "ev:sends(release)";
    v[ev_scattered()] = "ev:scattered";
    v[ev_done()] = "ev:done";
    return v;
  }
};

Op wait_op(OpKind kind, uint8_t stream, OpTag tag, int rank, int counter, int64_t value,
           int round = -1) {
  Op op;
  op.kind = kind;
  op.stream = stream;
  op.tag = tag;
  op.round = round;
  op.counter = {rank, counter};
  op.value = value;
  op.per_call = 1;
  return op;
}

Op signal_op(OpKind kind, uint8_t stream, OpTag tag, int rank, int counter, int round = -1) {
  Op op;
  op.kind = kind;
  op.stream = stream;
  op.tag = tag;
  op.round = round;
  op.counter = {rank, counter};
  op.value = 1;
  return op;
}

BufRef ref(BufKind kind, int rank, int index, int64_t offset, int64_t width, int64_t height = 1,
           int64_t pitch = 0) {
  BufRef b;
  b.kind = kind;
  b.rank = rank;
  b.index = index;
  b.offset = offset;
  b.width = width;
  b.height = height;
  b.pitch = height > 1 ? pitch : 0;
  return b;
}

struct Piece {  // a 1-D source piece of a round's byte stream
  BufRef src;
};

// Appends PUT ops carrying `stream_pieces` (concatenated) to dst bytes [dst_off, ...) of `peer`'s
// stage, split at `head` bytes into a head PUT (bumps HEAD) and a tail PUT (bumps TAIL).
void emit_round_puts(Program& prog, const std::vector<Piece>& pieces, int peer, BufKind dst_kind,
                     int64_t dst_off, int64_t head, int head_counter, int tail_counter, int d) {
  Op h, t;
  h.kind = t.kind = OpKind::kPut;
  h.stream = t.stream = kCaller;
  h.tag = OpTag::kRoundHead;
  t.tag = OpTag::kRoundTail;
  h.round = t.round = d;
  h.counter = {peer, head_counter};
  t.counter = {peer, tail_counter};
  h.value = t.value = 1;
  int64_t pos = 0;
  for (const auto& pc : pieces) {
    int64_t a = 0;
    const int64_t w = pc.src.width;
    while (a < w) {
      Op& target = pos + a < head ? h : t;
      const int64_t b = pos + a < head ? std::min(w, head - pos) : w;
      CopyDesc cd;
      cd.src = pc.src;
      cd.src.offset += a;
      cd.src.width = b - a;
      cd.dst = ref(dst_kind, peer, -1, dst_off + pos + a, b - a);
      target.copies.push_back(cd);
      a = b;
    }
    pos += w;
  }
  prog.ops.push_back(std::move(h));
  prog.ops.push_back(std::move(t));
}

// The paced Bruck rounds of `rank` = (n, l) on the caller stream ([Note: AG streams and
// counters]): round d waits CREDIT[d] >= e-1 (and PACE[d] >= e, d >= 1), PUTs `own` (the rank's
// shard, slot 0) followed by its stage slots 1..c_d-1 into stage slot 2^d of (n - 2^d, l), split
// into head and tail, waits its own HEAD[d], confirms to the round-(d+1) sender and waits its own
// TAIL[d]. The push and the pull programs share it, so both move the same rail bytes.
void emit_rounds(Program& prog, const Plan& plan, const AgCounters& C, int rank, const std::vector<Piece>& own,
                 bool cast, int64_t head_bytes) {
  const Topology& topo = plan.topo;
  const int M = topo.nodes, n = topo.node_of(rank), l = topo.local_of(rank);
  const int64_t S = plan.layout.S;
  for (int d = 0; d < plan.ag.rounds; ++d) {
    const int t = topo.rank(ag_send_peer(n, d, M), l);
    const int c_d = plan.ag.c[d];
    prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kCreditWait, rank, C.credit(d), -1, d));
    if (d >= 1) prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kPaceWait, rank, C.pace(d), 0, d));
    std::vector<Piece> pieces = own;
    if (c_d > 1) {
      const int64_t off = ag_stage_offset(1, S, cast);
      pieces.push_back({ref(BufKind::kStage, rank, 1, off, (c_d - 1) * S)});
    }
    emit_round_puts(prog, pieces, t, BufKind::kStage, ag_stage_offset(1 << d, S, cast),
                    head_bytes, C.head(d), C.tail(d), d);
    prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kArrivalWait, rank, C.head(d), 0, d));
    if (d + 1 < plan.ag.rounds)
      prog.ops.push_back(signal_op(OpKind::kSignal, kCaller, OpTag::kPaceSignal,
                                   topo.rank(ag_recv_peer(n, d + 1, M), l), C.pace(d + 1), d + 1));
    prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kArrivalWait, rank, C.tail(d), 0, d));
  }
}

Program base_program(const Plan& plan, const AgCallOptions& opt, int rank, int num_counters,
                     std::vector<std::string> names) {
  Program prog;
  prog.collective = Collective::kAllGather;
  prog.rank = rank;
  prog.topo = plan.topo;
  prog.plan_hash = plan.hash;
  prog.group = opt.group;
  prog.streams = {"caller", "readiness", "scatter", "completion"};
  prog.arena = arena_spec_for(plan, num_counters);
  prog.num_counters = num_counters;
  prog.counter_names = std::move(names);
  const int P = plan.layout.P;
  const int shard_item = dtype_size(plan.sig.shard_dtype);
  prog.user_buffer_bytes[static_cast<int>(BufKind::kShard)].assign(P + 1, 0);
  for (int p = 0; p < P; ++p)
    prog.user_buffer_bytes[static_cast<int>(BufKind::kShard)][p + 1] =
        plan.layout.params[p].e * shard_item;
  return prog;
}

// Mixed precision: every fp32 shard of `rank` cast into its stage slot 0 (at the packed offset),
// to the all-gather dtype (bf16 or fp16).
Op cast_op(const GroupLayout& lay, int rank, DType ag_dtype) {
  Op c;
  c.kind = OpKind::kCast;
  c.stream = kCaller;
  c.tag = OpTag::kCast;
  c.cast_to = ag_dtype;
  for (int p = 0; p < lay.P; ++p) {
    const auto& pl = lay.params[p];
    c.copies.push_back({ref(BufKind::kShard, rank, p, 0, pl.e * 4), ref(BufKind::kStage, rank, 0, pl.o, pl.s)});
  }
  return c;
}

// Rank g's rows of parameter p that exist (the last ranks' padding rows are not landed).
int64_t pull_rows(const GroupLayout& lay, int p, int g) {
  const auto& pl = lay.params[p];
  return std::max<int64_t>(0, std::min(pl.R, pl.D - g * pl.R));
}

// Where rank g's rows of parameter p land in `rank`'s own kLanding[p] (D_p rows, unpadded).
BufRef pull_dst(const GroupLayout& lay, int b_ag, int rank, int p, int g) {
  const auto& pl = lay.params[p];
  return ref(BufKind::kLanding, rank, p, g * pl.R * pl.K * b_ag, pull_rows(lay, p, g) * pl.K * b_ag);
}

// A pull program's user buffers: kLanding[p] (D_p rows) out, the shards (or the adopted resident
// region) in, and what each landed rank block must hold (its source's rows, cast).
void pull_landing_io(Program& prog, const Plan& plan, const AgCallOptions& opt, int rank, bool resident) {
  const GroupLayout& lay = plan.layout;
  const int b_ag = dtype_size(plan.sig.ag_dtype), b_shard = dtype_size(plan.sig.shard_dtype);
  auto& landing_bytes = prog.user_buffer_bytes[static_cast<int>(BufKind::kLanding)];
  landing_bytes.assign(lay.P + 1, 0);
  for (int p = 0; p < lay.P; ++p) {
    const auto& pl = lay.params[p];
    landing_bytes[static_cast<size_t>(p) + 1] = pl.D * pl.K * b_ag;
    prog.user_outputs.push_back(ref(BufKind::kLanding, rank, p, 0, pl.D * pl.K * b_ag));
    if (resident) prog.user_inputs.push_back(ref(BufKind::kResident, rank, -1, pl.o, pl.s));
    else prog.user_inputs.push_back(ref(BufKind::kShard, rank, p, 0, pl.e * b_shard));
    for (int g = 0; g < (opt.with_expects ? plan.topo.world() : 0); ++g) {
      const int64_t rows = pull_rows(lay, p, g);
      if (rows == 0) continue;
      Expect ex;
      ex.region = pull_dst(lay, b_ag, rank, p, g);
      ex.region_dtype = plan.sig.ag_dtype;
      ExpectSource es;
      es.dtype = plan.sig.shard_dtype;
      es.src = resident ? ref(BufKind::kResident, g, -1, pl.o, rows * pl.K * b_ag)
                        : ref(BufKind::kShard, g, p, 0, rows * pl.K * b_shard);
      ex.sources.push_back(es);
      prog.expects.push_back(std::move(ex));
    }
  }
}

// [Note: pull landing across nodes] (M > 1, a cast) Rank r = (n, l), call seq e. The stage, the
// paced Bruck rounds over rail l and their counters are the push program's ([Note: AG streams and
// counters]; emit_rounds), so the lowering to two-sided rails applies unchanged; every write into a
// local landing becomes a pull by the landing's owner. Area a of r's stage: a = 0 is slot 0 (r's
// cast shard), a = d + 1 the slots round d delivered. Per ordered pair of local ranks one counter
// each way, bumped once per area in area order (K = R + 1 bumps per call: area a of call e is
// reached at K (e-1) + a + 1): STAGED[l] on j (r's area a is readable) and PULLED[j] on r (j has
// pulled r's area a).
//   caller     wait PULLED[j] >= area 0 of call e-1 for every j, r itself included (every puller is
//              done with slot 0); CAST own fp32 shard -> slot 0; record STAGED (release: the shard
//              is read); the rounds; record FORWARDED (r's sends no longer read its stage).
//   readiness  wait STAGED-event >= e, SIGNAL STAGED[l] on every other local rank; per round d:
//              wait TAIL[d] >= e, SIGNAL STAGED[l] on them again (area d + 1).
//   pull       wait STAGED-event >= e (after the caller's prior work: the face's consumption of
//              the landing); per area a, for j = l, l+1, ... (mod L): wait STAGED[j] >= area a
//              (own: TAIL[a-1]), COPY the rows of the ranks area a holds from j's stage into r's
//              own kLanding[p] (the push scatter's runs: a strided copy per run of >= 4 full rank
//              blocks), SIGNAL PULLED[l] on j; record DONE (only r writes its landing).
//   credit     wait FORWARDED >= e; per round d: wait PULLED[j] >= area d + 1 of call e for every
//              j, then CREDIT[d] to the round-d sender: area d is free once every local puller
//              and r's own later rounds are done with it ([Note: credit placement]).
// No peer writes r's landing, so the executors' entry fence waits for the peers' previous run,
// never their arrival: one handshake per call. Bytes: the push program's rail bytes, and per
// rank the unpadded landing once (the push program writes L padded copies of every shard).
Program build_ag_pull_rounds_program(const Plan& plan, const AgCallOptions& opt, int rank) {
  enum PullStream : uint8_t { kPullCaller = 0, kPullReadiness = 1, kPullStream = 2, kPullCredit = 3 };
  const Topology& topo = plan.topo;
  const int M = topo.nodes, L = topo.gpus_per_node, R = plan.ag.rounds, K = R + 1;
  const int n = topo.node_of(rank), l = topo.local_of(rank);
  const GroupLayout& lay = plan.layout;
  const int P = lay.P;
  const int64_t S = lay.S;
  const int b_ag = dtype_size(plan.sig.ag_dtype);
  const int64_t head_opt = opt.head_bytes > 0 ? opt.head_bytes : plan.opt.ag_head_bytes;
  const int64_t head_bytes = head_opt > 0 ? std::max<int64_t>(16, head_opt / 16 * 16) : INT64_MAX;
  AgCounters C{L, R};
  std::vector<std::string> names = C.names();
  for (int j = 0; j < L; ++j) {
    names[C.ready(j)] = TIDE_STR_CAT("STAGED[", j, "]");
    names[C.done(j)] = TIDE_STR_CAT("PULLED[", j, "]");
  }
  names[C.ev_pushed()] = "ev:forwarded";
  names[C.ev_sends()] = "ev:staged(release)";
  names[C.ev_scattered()] = "(unused)";
  Program prog = base_program(plan, opt, rank, C.count(), std::move(names));
  prog.arena = pull_arena_spec_for(plan, prog.num_counters);  // the stage and counters ([Note: pulled arena])
  prog.streams = {"caller", "readiness", "pull", "credit"};
  prog.release_event = C.ev_sends();
  prog.done_event = C.ev_done();
  pull_landing_io(prog, plan, opt, rank, false);
  // A wait for area a of call e + call_offset on a per-area counter (K bumps per call).
  auto area_wait = [&](uint8_t stream, OpTag tag, int counter, int a, int call_offset) {
    Op w = wait_op(OpKind::kWait, stream, tag, rank, counter, a + 1 - K + int64_t{call_offset} * K, a - 1);
    w.per_call = K;
    return w;
  };

  // ---- caller stream ----
  for (int j = 0; j < L; ++j) prog.ops.push_back(area_wait(kPullCaller, OpTag::kCastGate, C.done(j), 0, -1));
  prog.ops.push_back(cast_op(lay, rank, plan.sig.ag_dtype));
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kPullCaller, OpTag::kRelease, rank, C.ev_sends(), 0));
  emit_rounds(prog, plan, C, rank, {{ref(BufKind::kStage, rank, 0, 0, S)}}, true, head_bytes);
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kPullCaller, OpTag::kFence, rank, C.ev_pushed(), 0));

  // ---- readiness stream: each area of r's stage, once it holds call e's rows ----
  prog.ops.push_back(wait_op(OpKind::kEventWait, kPullReadiness, OpTag::kReadyWait, rank, C.ev_sends(), 0));
  for (int a = 0; a <= R; ++a) {
    if (a > 0)
      prog.ops.push_back(wait_op(OpKind::kWait, kPullReadiness, OpTag::kArrivalWait, rank, C.tail(a - 1), 0, a - 1));
    for (int j = 0; j < L; ++j)
      if (j != l)
        prog.ops.push_back(signal_op(OpKind::kSignal, kPullReadiness, OpTag::kReadySignal, topo.rank(n, j),
                                     C.ready(l), a - 1));
  }

  // ---- pull stream ----
  // The runs of stage slots each round delivered (nodes n + first_slot + i, never across the wrap).
  const auto runs = ag_scatter_runs(plan.ag, M, n);
  prog.ops.push_back(wait_op(OpKind::kEventWait, kPullStream, OpTag::kFence, rank, C.ev_sends(), 0));
  for (int a = 0; a <= R; ++a) {
    if (a > 0)
      prog.ops.push_back(wait_op(OpKind::kWait, kPullStream, OpTag::kArrivalWait, rank, C.tail(a - 1), 0, a - 1));
    for (int i = 0; i < L; ++i) {
      const int j = (l + i) % L, q = topo.rank(n, j);
      if (j != l) prog.ops.push_back(area_wait(kPullStream, OpTag::kReadyGate, C.ready(j), a, 0));
      Op pull;
      pull.kind = OpKind::kCopy;
      pull.stream = kPullStream;
      pull.tag = OpTag::kPull;
      pull.round = a - 1;
      // Slots [first, first + slots) of q's stage hold ranks (n + first + i, j): rank blocks L apart
      // in the landing. The full blocks come first (the valid rows only shrink with the rank).
      auto add_run = [&](int first, int slots) {
        const int g0 = topo.rank((n + first) % M, j);
        for (int p = 0; p < P; ++p) {
          const auto& pl = lay.params[p];
          const int64_t block = pl.R * pl.K * b_ag;
          int full = 0;
          while (full < slots && pull_rows(lay, p, g0 + full * L) == pl.R) ++full;
          const int strided = full >= kAgMinStridedRun ? full : 0;
          if (strided > 0)
            pull.copies.push_back({ref(BufKind::kStage, q, first, ag_stage_offset(first, S, true) + pl.o, block,
                                       strided, S),
                                   ref(BufKind::kLanding, rank, p, g0 * block, block, strided, L * block)});
          for (int s = strided; s < slots; ++s) {
            const int g = g0 + s * L;
            const int64_t rows = pull_rows(lay, p, g);
            if (rows == 0) break;
            pull.copies.push_back({ref(BufKind::kStage, q, first + s, ag_stage_offset(first + s, S, true) + pl.o,
                                       rows * pl.K * b_ag),
                                   pull_dst(lay, b_ag, rank, p, g)});
          }
        }
      };
      if (a == 0) add_run(0, 1);
      for (const auto& run : runs)
        if (a > 0 && run.round == a - 1) add_run(run.first_slot, run.slots);
      if (!pull.copies.empty()) prog.ops.push_back(std::move(pull));
      prog.ops.push_back(signal_op(OpKind::kCredit, kPullStream, OpTag::kCreditSignal, q, C.done(l), a - 1));
    }
  }
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kPullStream, OpTag::kComplete, rank, C.ev_done(), 0));

  // ---- credit stream ----
  prog.ops.push_back(wait_op(OpKind::kEventWait, kPullCredit, OpTag::kFence, rank, C.ev_pushed(), 0));
  for (int d = 0; d < R; ++d) {
    for (int j = 0; j < L; ++j) prog.ops.push_back(area_wait(kPullCredit, OpTag::kCreditWait, C.done(j), d + 1, 0));
    prog.ops.push_back(signal_op(OpKind::kCredit, kPullCredit, OpTag::kCreditSignal,
                                 topo.rank(ag_recv_peer(n, d, M), l), C.credit(d), d));
  }
  return prog;
}

// [Note: pull landing] (program.h) One node (M > 1: [Note: pull landing across nodes] above).
// Rank r = l of the one node, call seq e, all on the caller stream (the counters reuse the push
// program's slots, so both reserve the same range):
//   [wait PULLED[j] >= e-1 for every j: every puller has finished call e-1 with r's stage slot;
//    CAST own fp32 shard -> stage slot 0; record SENDS (release)]
//   SIGNAL STAGED[l] on every local rank (r's shard of call e is readable in its arena);
//   for j = l, l+1, ... (mod L): wait STAGED[j] >= e (j != l); COPY j's rows [j R_p, min(D_p, (j+1) R_p))
//   of every parameter from j's stage (or resident region) into r's own kLanding[p] (XLA's
//   unpadded result); SIGNAL PULLED[l] on j;
//   [resident: wait PULLED[j] >= e for every j (peers read r's resident shards until then);
//    record SENDS]; record DONE.
// Only r writes r's landing, and only after its caller stream's prior work (the face's previous
// consumption of it), so no readiness round is needed. Bytes per rank and call: the cast (S/N)
// and S of pulls, the push design's bytes without its copy-out of the arena landing.
Program build_ag_pull_program(const Plan& plan, const AgCallOptions& opt, int rank) {
  const Topology& topo = plan.topo;
  const int L = topo.gpus_per_node;
  const GroupLayout& lay = plan.layout;
  const int P = lay.P;
  const bool cast = plan.sig.needs_cast();
  const bool resident = opt.resident && !cast;
  TIDE_PLAN_CHECK(!opt.expert_lane && !opt.multicast, "AgCallOptions.pull_landing: not with the expert lane or "
                  "multicast");
  TIDE_PLAN_CHECK(topo.nodes == 1 || cast, "AgCallOptions.pull_landing: across nodes (M = ", topo.nodes, ") the "
                  "peers pull from the stage, which needs a cast (fp32 shards); a ",
                  dtype_name(plan.sig.shard_dtype), " shard group pushes");
  if (topo.nodes > 1) return build_ag_pull_rounds_program(plan, opt, rank);
  TIDE_PLAN_CHECK(cast || resident, "AgCallOptions.pull_landing: peers pull from a stage (a cast) or the resident "
                  "region; a ", dtype_name(plan.sig.shard_dtype), " shard that is neither lives in a user buffer");
  AgCounters C{L, 0};
  std::vector<std::string> names = C.names();
  for (int j = 0; j < L; ++j) {
    names[C.ready(j)] = TIDE_STR_CAT("STAGED[", j, "]");
    names[C.done(j)] = TIDE_STR_CAT("PULLED[", j, "]");
  }
  Program prog = base_program(plan, opt, rank, C.count(), std::move(names));
  prog.arena = pull_arena_spec_for(plan, prog.num_counters);  // [Note: pulled arena] in tide/plan.h
  prog.streams = {"caller"};
  prog.release_event = C.ev_sends();
  prog.done_event = C.ev_done();
  pull_landing_io(prog, plan, opt, rank, resident);
  const int b_ag = dtype_size(plan.sig.ag_dtype);
  auto rows = [&](int p, int j) { return pull_rows(lay, p, j); };
  auto src_of = [&](int p, int j) {
    const auto& pl = lay.params[p];
    return cast ? ref(BufKind::kStage, j, 0, pl.o, rows(p, j) * pl.K * b_ag)
                : ref(BufKind::kResident, j, -1, pl.o, rows(p, j) * pl.K * b_ag);
  };
  auto dst_of = [&](int p, int j) { return pull_dst(lay, b_ag, rank, p, j); };
  const int l = topo.local_of(rank);
  if (cast) {
    for (int j = 0; j < L; ++j)
      prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kCastGate, rank, C.done(j), -1));
    prog.ops.push_back(cast_op(lay, rank, plan.sig.ag_dtype));
    prog.ops.push_back(wait_op(OpKind::kEventRecord, kCaller, OpTag::kRelease, rank, C.ev_sends(), 0));
  }
  for (int j = 0; j < L; ++j)
    prog.ops.push_back(signal_op(OpKind::kSignal, kCaller, OpTag::kReadySignal, topo.rank(0, j), C.ready(l)));
  for (int i = 0; i < L; ++i) {
    const int j = (l + i) % L;
    if (j != l)  // the own stage: written earlier on this stream
      prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kReadyGate, rank, C.ready(j), 0));
    Op pull;
    pull.kind = OpKind::kCopy;
    pull.stream = kCaller;
    pull.tag = OpTag::kPull;
    for (int p = 0; p < P; ++p)
      if (rows(p, j) > 0) pull.copies.push_back({src_of(p, j), dst_of(p, j)});
    if (!pull.copies.empty()) prog.ops.push_back(std::move(pull));
    prog.ops.push_back(signal_op(OpKind::kCredit, kCaller, OpTag::kCreditSignal, topo.rank(0, j), C.done(l)));
  }
  if (!cast) {
    for (int j = 0; j < L; ++j)
      prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kCreditWait, rank, C.done(j), 0));
    prog.ops.push_back(wait_op(OpKind::kEventRecord, kCaller, OpTag::kRelease, rank, C.ev_sends(), 0));
  }
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kCaller, OpTag::kComplete, rank, C.ev_done(), 0));
  return prog;
}

}  // namespace

Program build_ag_program(const Plan& plan, const AgCallOptions& opt, int rank) {
  TIDE_PLAN_CHECK(opt.struct_size == sizeof(AgCallOptions), "AgCallOptions.struct_size: ",
                  opt.struct_size, " does not match this build's ", sizeof(AgCallOptions));
  TIDE_PLAN_CHECK(opt.ring_slot == 0 || opt.ring_slot == 1, "AgCallOptions.ring_slot: must be 0 or 1, got ",
                  opt.ring_slot);
  const Topology& topo = plan.topo;
  const int M = topo.nodes, L = topo.gpus_per_node, N = topo.world(), R = plan.ag.rounds;
  TIDE_PLAN_CHECK(rank >= 0 && rank < N, "rank ", rank, " is outside [0, ", N, ")");
  if (opt.pull_landing) return build_ag_pull_program(plan, opt, rank);
  TIDE_PLAN_CHECK(!opt.expert_lane || L == 1, "AgCallOptions.expert_lane: the L_sub = 1 lane needs a "
                  "plan with gpus_per_node = 1 (one rank per node), got L = ", L);
  TIDE_PLAN_CHECK(!opt.expert_lane || !plan.sig.needs_cast(), "AgCallOptions.expert_lane: the lane "
                  "reads shards in place and does not cast (shard dtype must equal the AG dtype)");
  const GroupLayout& lay = plan.layout;
  const int P = lay.P;
  const int64_t S = lay.S;
  const bool cast = plan.sig.needs_cast();
  const bool resident = opt.resident && !cast;
  const int n = topo.node_of(rank), l = topo.local_of(rank);
  const BufKind ring = opt.ring_slot == 0 ? BufKind::kRing0 : BufKind::kRing1;
  const int64_t head_opt = opt.head_bytes > 0 ? opt.head_bytes : plan.opt.ag_head_bytes;
  // Heads end on a 16-byte boundary so no element straddles the head/tail split.
  const int64_t head_bytes = head_opt > 0 ? std::max<int64_t>(16, head_opt / 16 * 16) : INT64_MAX;

  AgCounters C{L, R};
  Program prog = base_program(plan, opt, rank, C.count(), C.names());
  prog.release_event = C.ev_sends();
  prog.done_event = C.ev_done();

  // Own shard of parameter p (slot 0): adopted resident region, the cast output in stage
  // position 0, or the user's shard buffer.
  auto own_src = [&](int p) {
    const auto& pl = lay.params[p];
    if (cast) return ref(BufKind::kStage, rank, 0, pl.o, pl.s);
    if (resident) return ref(BufKind::kResident, rank, -1, pl.o, pl.s);
    return ref(BufKind::kShard, rank, p, 0, pl.s);
  };
  // User inputs (rewritten by the user after release) and what each landing byte must hold.
  if (resident) {
    prog.user_inputs.push_back(ref(BufKind::kResident, rank, -1, 0, S));
  } else {
    const int item = dtype_size(plan.sig.shard_dtype);
    for (int p = 0; p < P; ++p)
      prog.user_inputs.push_back(ref(BufKind::kShard, rank, p, 0, lay.params[p].e * item));
  }
  prog.user_outputs.push_back(ref(ring, rank, -1, 0, lay.unsharded_bytes()));
  for (int src = 0; src < (opt.with_expects ? N : 0); ++src) {
    for (int p = 0; p < P; ++p) {
      const auto& pl = lay.params[p];
      Expect ex;
      ex.region = ref(ring, rank, -1, lay.landing(p, src), pl.s);
      ex.region_dtype = plan.sig.ag_dtype;
      ExpectSource es;
      es.dtype = plan.sig.shard_dtype;
      es.src = resident ? ref(BufKind::kResident, src, -1, pl.o, pl.s)
                        : ref(BufKind::kShard, src, p, 0, pl.e * dtype_size(plan.sig.shard_dtype));
      ex.sources.push_back(es);
      prog.expects.push_back(std::move(ex));
    }
  }

  if (opt.expert_lane) {
    // [Note: expert lane] One rank per node (rail peers only). The own shard is copied into the
    // own landing, then round d PUTs the landing rows of nodes n..n+c_d-1 (mod M) straight into
    // the same landing offsets of node n-2^d. A receiver's landing is reusable once it consumed
    // the previous call, so its readiness stream credits each round's sender (CREDIT[d] >= e).
    Op own;
    own.kind = OpKind::kCopy;
    own.stream = kCaller;
    own.tag = OpTag::kLocalPush;
    for (int p = 0; p < P; ++p)
      own.copies.push_back({own_src(p), ref(ring, rank, -1, lay.landing(p, rank), lay.params[p].s)});
    prog.ops.push_back(wait_op(OpKind::kEventWait, kCaller, OpTag::kReadyGate, rank, C.ev_done(), -1));
    prog.ops.push_back(std::move(own));
    for (int d = 0; d < R; ++d) {
      const int t = ag_send_peer(n, d, M);
      prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kCreditWait, rank, C.credit(d), 0, d));
      Op put;
      put.kind = OpKind::kPut;
      put.stream = kCaller;
      put.tag = OpTag::kRoundTail;
      put.round = d;
      put.counter = {t, C.tail(d)};
      put.value = 1;
      // Slots [0, c_d) = nodes n..n+c_d-1 (mod M): contiguous per parameter except at the wrap.
      int i = 0;
      while (i < plan.ag.c[d]) {
        const int node = (n + i) % M;
        const int len = std::min(plan.ag.c[d] - i, M - node);
        for (int p = 0; p < P; ++p) {
          const int64_t off = lay.landing(p, node), w = len * lay.params[p].s;
          put.copies.push_back({ref(ring, rank, -1, off, w), ref(ring, t, -1, off, w)});
        }
        i += len;
      }
      prog.ops.push_back(std::move(put));
      prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kArrivalWait, rank, C.tail(d), 0, d));
    }
    prog.ops.push_back(wait_op(OpKind::kEventRecord, kCaller, OpTag::kRelease, rank, C.ev_sends(), 0));
    prog.ops.push_back(wait_op(OpKind::kEventWait, kReadiness, OpTag::kReadyWait, rank, C.ev_done(), -1));
    for (int d = 0; d < R; ++d)
      prog.ops.push_back(signal_op(OpKind::kCredit, kReadiness, OpTag::kCreditSignal,
                                   ag_recv_peer(n, d, M), C.credit(d), d));
    // Completion: every round arrived and our own sends (which read the landing) are done.
    prog.ops.push_back(wait_op(OpKind::kEventWait, kCompletion, OpTag::kFence, rank, C.ev_sends(), 0));
    prog.ops.push_back(wait_op(OpKind::kEventRecord, kCompletion, OpTag::kComplete, rank, C.ev_done(), 0));
    return prog;
  }

  // ---- caller stream ----
  if (cast) prog.ops.push_back(cast_op(lay, rank, plan.sig.ag_dtype));
  for (int j = 0; j < L; ++j)
    prog.ops.push_back(wait_op(OpKind::kWait, kCaller, OpTag::kReadyGate, rank, C.ready(j), 0));
  {
    Op push;
    push.kind = OpKind::kCopy;
    push.stream = kCaller;
    push.tag = OpTag::kLocalPush;
    push.multicast = opt.multicast;
    for (int j = 0; j < L; ++j)
      for (int p = 0; p < P; ++p)
        push.copies.push_back(
            {own_src(p), ref(ring, topo.rank(n, j), -1, lay.landing(p, rank), lay.params[p].s)});
    prog.ops.push_back(std::move(push));
  }
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kCaller, OpTag::kFence, rank, C.ev_pushed(), 0));
  {
    std::vector<Piece> own;  // slot 0 of every round's byte stream: this rank's shard
    if (cast || resident) {
      own.push_back({cast ? ref(BufKind::kStage, rank, 0, 0, S) : ref(BufKind::kResident, rank, -1, 0, S)});
    } else {
      for (int p = 0; p < P; ++p) own.push_back({own_src(p)});
    }
    emit_rounds(prog, plan, C, rank, own, cast, head_bytes);
  }
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kCaller, OpTag::kRelease, rank, C.ev_sends(), 0));

  // ---- readiness stream ----
  prog.ops.push_back(wait_op(OpKind::kEventWait, kReadiness, OpTag::kReadyWait, rank, C.ev_done(), -1));
  for (int j = 0; j < L; ++j)
    prog.ops.push_back(signal_op(OpKind::kSignal, kReadiness, OpTag::kReadySignal, topo.rank(n, j), C.ready(l)));

  // ---- scatter stream ----
  for (int j = 0; j < L; ++j)
    prog.ops.push_back(wait_op(OpKind::kWait, kScatterStream, OpTag::kReadyGate, rank, C.ready(j), 0));
  const auto runs = ag_scatter_runs(plan.ag, M, n);
  int waited = -1;
  for (const auto& run : runs) {
    if (run.round != waited) {
      prog.ops.push_back(wait_op(OpKind::kWait, kScatterStream, OpTag::kArrivalWait, rank,
                                 C.tail(run.round), 0, run.round));
      waited = run.round;
    }
    Op sc;
    sc.kind = OpKind::kCopy;
    sc.stream = kScatterStream;
    sc.tag = OpTag::kScatter;
    sc.round = run.round;
    sc.multicast = opt.multicast;
    const int src_rank0 = topo.rank((n + run.first_slot) % M, l);
    const int64_t src0 = ag_stage_offset(run.first_slot, S, cast);
    for (int j = 0; j < L; ++j) {
      const int dst = topo.rank(n, j);
      for (int p = 0; p < P; ++p) {
        const auto& pl = lay.params[p];
        if (run.slots >= kAgMinStridedRun) {
          sc.copies.push_back({ref(BufKind::kStage, rank, run.first_slot, src0 + pl.o, pl.s, run.slots, S),
                               ref(ring, dst, -1, lay.landing(p, src_rank0), pl.s, run.slots, L * pl.s)});
        } else {
          for (int i = 0; i < run.slots; ++i)
            sc.copies.push_back({ref(BufKind::kStage, rank, run.first_slot + i, src0 + i * S + pl.o, pl.s),
                                 ref(ring, dst, -1, lay.landing(p, src_rank0 + i * L), pl.s)});
        }
      }
    }
    prog.ops.push_back(std::move(sc));
  }
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kScatterStream, OpTag::kFence, rank, C.ev_scattered(), 0));
  if (R > 0) {
    prog.ops.push_back(wait_op(OpKind::kEventWait, kScatterStream, OpTag::kFence, rank, C.ev_sends(), 0));
    for (int d = 0; d < R; ++d)
      prog.ops.push_back(signal_op(OpKind::kCredit, kScatterStream, OpTag::kCreditSignal,
                                   topo.rank(ag_recv_peer(n, d, M), l), C.credit(d), d));
  }

  // ---- completion stream ----
  prog.ops.push_back(wait_op(OpKind::kEventWait, kCompletion, OpTag::kFence, rank, C.ev_pushed(), 0));
  prog.ops.push_back(wait_op(OpKind::kEventWait, kCompletion, OpTag::kFence, rank, C.ev_scattered(), 0));
  for (int j = 0; j < L; ++j)
    prog.ops.push_back(signal_op(OpKind::kSignal, kCompletion, OpTag::kDoneSignal, topo.rank(n, j), C.done(l)));
  for (int j = 0; j < L; ++j)
    prog.ops.push_back(wait_op(OpKind::kWait, kCompletion, OpTag::kDoneWait, rank, C.done(j), 0));
  prog.ops.push_back(wait_op(OpKind::kEventRecord, kCompletion, OpTag::kComplete, rank, C.ev_done(), 0));
  return prog;
}

std::vector<Program> build_ag_programs(const Plan& plan, const AgCallOptions& opt) {
  std::vector<Program> progs;
  progs.reserve(plan.topo.world());
  for (int r = 0; r < plan.topo.world(); ++r) progs.push_back(build_ag_program(plan, opt, r));
  return progs;
}

}  // namespace tide
