// TIDE programs: the schedule of one collective call as per-rank op lists on named streams.
//
// Contract
//   - Lifecycle: a builder (csrc/program/*_program.cc) compiles a Plan plus call options into
//     one Program per rank, once per (plan, options). A Program is immutable and seq-independent:
//     the call sequence number `seq` (1, 2, 3, ... per group, identical on every rank) is supplied
//     when a call runs, and every counter target is `value + per_call * seq`. Counters are
//     monotonically increasing epochs and are never reset, so one Program serves every call.
//   - Ownership: a Program owns nothing but descriptions. User buffers (shard[p], grad[p],
//     landing, out) are bound per call by the executor; arena regions (ring0, ring1, resident,
//     stage, staging, outbox, inbox, spare, counters) are owned by the executor's arena and are
//     symmetric: the same region offsets on every rank (ArenaSpec).
//   - Streams: `Program::streams` names the rank's internal streams (e.g. caller, readiness,
//     scatter, completion for TIDE-AG). Ops of one stream run in the order they appear in
//     `ops`; ops of different streams are ordered only by WAIT/EVENT_WAIT. Across calls a stream
//     continues in order (call e+1's caller ops queue behind call e's), as CUDA streams do.
//   - The push rule (makes multi-process and GPU execution possible):
//       * a rank reads and writes user buffers of its own rank only;
//       * every cross-rank access targets ARENA memory: a COPY/CAST may write a local peer's arena
//         (NVLink push), a PUT writes a rail peer's arena, LAND may read the aligned inbox
//         blocks of local peers (the multimem ld_reduce shape), and a COPY may read a local
//         peer's arena (TIDE-AG's pull landing, [Note: pull landing]);
//       * a PUT's counter bump becomes visible only after its data (release); a WAIT that sees
//         the bump sees the data (acquire).
//   - Counters (CounterRef): per rank, `num_counters` uint64 slots in the arena "counters" region.
//     SIGNAL/CREDIT/PUT add `value`; EVENT_RECORD stores max(current, value + per_call*seq);
//     WAIT/EVENT_WAIT block until counter >= value + per_call*seq (or the executor's deadline
//     passes: tide::TimeoutError naming rank, op index + kind and seq). [Note: single producer]
//     every counter has exactly one producing (rank, stream); the checker rejects programs that
//     break this, because only then does "counter >= T" name one producing op (the T-th bump),
//     which is what lets it prove I4 and order memory accesses exactly.
//   - Events are counters too (rank-local by convention: EVENT_RECORD/EVENT_WAIT name their own
//     rank), so cross-call event waits ("this rank's previous scatter") are just target seq-1.
//   - User-visible lifetime (what the checker assumes of the caller):
//       * user_inputs may be rewritten by the user once `release_event` reaches seq (I2);
//       * user_outputs are consumed by the user once `done_event` reaches seq, and must then hold
//         exactly `expects` (I1); the next call may overwrite them only after that consumption.
//
//   - Stream 0 is the caller's stream (the framework's stream). [Note: the user model] The
//     user issues call e+1 only after it observed call e's release_event (for the same group)
//     and rewrote its user_inputs; so call e+1's stream-0 ops are ordered after that rewrite,
//     while the other internal streams are ordered only by their own waits. The checker (and
//     any executor that pipelines calls) relies on exactly this and nothing more.
//   - TIDE-AG's streams and counters are described in csrc/program/ag_program.cc
//     ([Note: AG streams and counters]); TIDE-RS programs follow the same rules.
//
// Backward compatibility: the RS and CUDA engineers build on this header. Changes are additive
// only (new enum values appended, new fields with defaults appended to structs). Change log:
//   v1 — initial IR (BufKind, BufRef, CopyDesc, SumTerm, Op, Program, Expect, ArenaSpec).
//        Op::deadline_s (per-wait deadline) added before first merge.
//   v1+ — ProgramGenerator and Call::generator (programs generated while they run; CPU executor only).
//   v1+ — Program::sum_ctas / land_ctas: the CTA budgets of the program's SUM and LAND ops (the
//        plan's solver, Eqs. 13-14, stamped by the RS builders; a session may override them).
//   v1+ — two-sided rails: OpKind::kSend / kRecv, Op::rail_group, Program::rails and
//        lower_two_sided() ([Note: two-sided rails]).
//   v1+ — SUM honours alpha and accumulate (as LAND) when alpha != 1 or accumulate is set.
//   v1+ — Rails (with rails_name/parse_rails) lives here, beside Program::rails; it was declared in
//        exec_options.h, which now includes this header. Collective gains kReduceScatterExpert
//        (the session's expert lane; its programs carry kReduceScatter) and collective_name().
//   v1+ — inject_fault narrows by Op::round too (kAnyRound: any); AgCallOptions.pull_landing
//        across nodes ([Note: pull landing]).
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "tide/plan.h"

namespace tide {

constexpr int kProgramIrVersion = 1;

// ---------------------------------------------------------------------------------------------
// Buffers
// ---------------------------------------------------------------------------------------------
enum class BufKind : uint8_t {
  // User buffers, bound per call, rank-local only. `index` selects the buffer.
  kShard = 0,    // shard[p]: the rank's padded shard of parameter p (s_p bytes; fp32 with a cast)
  kLanding = 1,  // a landing outside the arena: index -1 = group buffer (NS), p = per-param
  kGrad = 2,     // grad[p]: the rank's unsharded gradient of parameter p (RS input)
  kOut = 3,      // out: the rank's fp32 output shard (RS output, S_fp32 bytes)
  // Arena regions (symmetric, registered); names as in MemoryModel::arena. `index` is a tag
  // (slot / bank / block / generation) for messages; `offset` is from the region start.
  kRing0 = 4,     // AG landing, ring slot 0 (NS)
  kRing1 = 5,     // AG landing, ring slot 1 (NS)
  kResident = 6,  // adopted shards (S), the AG source when the shard dtype is the AG dtype
  kStage = 7,     // AG receive stage: (M-1)S, MS with a cast
  kStaging = 8,   // RS Level-1 bf16 staging slots
  kOutbox = 9,    // RS outbox banks
  kInbox = 10,    // RS inbox generations
  kSpare = 11,    // RS own-node spares
};
constexpr int kNumBufKinds = 12;
inline bool is_user_buffer(BufKind k) { return static_cast<int>(k) < 4; }
const char* buf_kind_name(BufKind k);  // "shard", ..., "ring0", ... (MemoryModel names)

// A region of one buffer: `height` rows of `width` bytes, `pitch` bytes apart (pitch is ignored
// when height == 1). Extents never exceed the bound buffer/region (executors check).
struct BufRef {
  BufKind kind = BufKind::kShard;
  int32_t rank = 0;    // owner rank (global)
  int32_t index = -1;  // user: param p (-1: the whole buffer); arena: tag
  int64_t offset = 0;  // bytes from the start of the buffer / region
  int64_t width = 0;   // bytes per row
  int64_t height = 1;  // rows
  int64_t pitch = 0;   // bytes between row starts
  int64_t bytes() const { return width * height; }
  int64_t end() const { return offset + (height > 1 ? (height - 1) * pitch : 0) + width; }
};

// One 1-D or 2-D copy: src and dst have the same width and height (CAST: src.width is twice
// dst.width, fp32 -> Op::cast_to (bf16 or fp16) round-to-nearest-even, tide/numerics.h).
struct CopyDesc {
  BufRef src;
  BufRef dst;
};

// One piece of a SUM/LAND operand: `elems` elements of `dtype` read contiguously from `src`
// (src.width = elems * dtype_size), added into output elements [dst_elem, dst_elem + elems).
// Operand order is `term` ascending (fixed order => bitwise reproducible); output elements not
// covered by any piece of a term count as zero for that term (valid extents: padding needs no
// memory).
struct SumTerm {
  BufRef src;
  DType dtype = DType::kBF16;
  int64_t dst_elem = 0;
  int64_t elems = 0;
  int32_t term = 0;
};

struct CounterRef {
  int32_t rank = 0;
  int32_t index = -1;
};

enum class OpKind : uint8_t {
  kCopy = 0,         // batch of CopyDesc (any may target a local peer's arena)
  kCast = 1,         // batch of CopyDesc, fp32 -> cast_to (bf16 or fp16)
  kSum = 2,          // dst (fp32) = sum over terms in order (valid extents); with alpha != 1 or
                     // accumulate, as LAND: [accumulate ? dst : 0] + alpha * sum (a direct
                     // Level-1 SUM into the output, [Note: direct Level 1] in plan.h)
  kLand = 3,         // dst (fp32 out) = [accumulate ? dst : 0] + alpha * sum over terms in order
  kZero = 4,         // zero dst (stale blocks)
  kPut = 5,          // batch of CopyDesc to ONE rail peer's arena, then counter += value there
  kSignal = 6,       // counter += value (counter may live on a peer)
  kWait = 7,         // counter >= value + per_call*seq, with the executor's deadline
  kEventRecord = 8,  // own counter = max(counter, value + per_call*seq)
  kEventWait = 9,    // own counter >= value + per_call*seq
  kCredit = 10,      // like SIGNAL; marks a buffer-reuse credit (fault injection targets it)
  kSend = 11,        // two-sided rail transfer out: copies (src own, dst the rail peer's arena where
                     // the matching RECV lands them), ONE peer; member of group `rail_group`
  kRecv = 12,        // two-sided rail transfer in: copies (src the peer's, as its SEND names them;
                     // dst own arena), ONE peer; own counter += value once its group completed
};
// [Note: two-sided rails] A rank reaches the ranks of its own node by pointer (COPY, PUT, SIGNAL
// into their arenas) and every other node only through its rail communicator, whose transport is
// two-sided (NCCL send/recv, torch.distributed send/recv). lower_two_sided() rewrites a built
// one-sided program set into that form (Program::rails = kTwoSided):
//   - each cross-node PUT becomes a SEND on the sender and the matching RECV on the receiver, in a
//     new stream "rail_p2p" on both; the PUT's stream records a local event where the PUT was
//     and waits for the transfer's completion event right after (the PUT's stream order stays);
//   - the RECV bumps the receiver's own arrival counter (its producer becomes the receiver's
//     rail_p2p stream: every counter keeps one producer);
//   - a cross-node SIGNAL/CREDIT (a credit or pace signal from a receiver to its sender) becomes
//     the same op on a fresh local counter of the signalling rank, and the sender's waits on it
//     move to the receiver's rail_p2p stream, just before the RECV of the transfer they guarded
//     (the next PUT to that rank on the waiting stream): a two-sided receive is posted only once
//     its buffer is free, so the sender needs no credit;
//   - transfers are keyed by (round, tag, ordinal) and grouped one group per round where the
//     schedule allows: consecutive keys of one round share a group when every transfer of the
//     later key has no moved wait and directly follows its sender's previous transfer of the
//     group on the same stream (no op between them there), e.g. a Bruck round's head and tail.
//     A rank's transfers of one group then form one unit on their stream: one local event pair
//     (recorded at the unit's last PUT) instead of one per PUT, so the sender does not wait for
//     the first transfer before posting the group that carries both. Other keys keep a group of
//     their own (e.g. an RS wave's transfers, which a sent event or a credit separates);
//   - group g of rank r holds one SEND per peer and one RECV per peer (consecutive ops with
//     rail_group = g, one ncclGroupStart/End); a peer's PUTs of the group become that SEND's rows
//     in key order, a row that continues the previous one in both source and destination (same
//     buffer and index) extending it into one larger message. The RECV bumps the first PUT's
//     counter; the others' counters (and an empty PUT's) are bumped by SIGNALs on rail_p2p right
//     after the group, once its data has landed;
//   - every rank issues its groups in the same key order, so matched groups meet (the checker
//     proves it: matching, sizes, order, rendezvous deadlock freedom).
// A rendezvous group completes once every peer holding a matched transfer has posted its group;
// a RECV's bytes are those the SEND read. Sends and receives are 1-D descriptors, matched in
// order per (sender, receiver) pair: the k-th SEND descriptor with the k-th RECV descriptor.
// rail_stats() counts a program's groups, SENDs and messages per call.
const char* op_kind_name(OpKind k);

// What an op is for: lets traces, messages and fault injection name ops without string labels.
enum class OpTag : uint16_t {
  kNone = 0,
  kReadyWait,      // readiness: the landing is free (previous consumption)
  kReadySignal,    // readiness: publish local readiness to a local peer
  kReadyGate,      // caller: wait for a local peer's readiness before pushing into it
  kCast,           // mixed precision: cast into the first stage slot
  kCastGate,       // wait before overwriting stage slot 0 (previous call released it)
  kLocalPush,      // own shard into every local landing (multicast / L unicasts)
  kCreditWait,     // round sender: receiver released the area (previous call)
  kPaceWait,       // round d >= 1: target confirmed round d-1 arrived
  kPaceSignal,     // confirm round d-1 arrival to the round-d sender
  kRoundHead,      // PUT of a round's head
  kRoundTail,      // PUT of a round's tail
  kArrivalWait,    // wait for a PUT's data; executors may verify the PUT's checksum here
  kScatter,        // received stage slots -> all local landings
  kCreditSignal,   // release a stage area to its sender
  kDoneSignal,     // completion: this rank's writes into a local peer's landing are done
  kDoneWait,       // completion fence: all local writers done
  kFence,          // event record/wait joining internal streams
  kRelease,        // read completion (sources may be rewritten)
  kComplete,       // consumable (the event the framework waits on)
  kPull,           // pull landing: a local peer's staged or resident shard -> the own landing
  kRsFirst = 100,  // TIDE-RS tags start here (owned by the RS builder)
};
const char* op_tag_name(OpTag t);  // "LocalPush", ...; "rs+N" for TIDE-RS tags

struct Op {
  OpKind kind = OpKind::kCopy;
  uint8_t stream = 0;
  OpTag tag = OpTag::kNone;
  int32_t round = -1;               // round / wave / pass index, for messages (-1: none)
  std::vector<CopyDesc> copies;     // COPY, CAST, PUT
  std::vector<SumTerm> terms;       // SUM, LAND
  BufRef dst;                       // SUM, LAND (1-D, fp32), ZERO (1-D or 2-D)
  CounterRef counter;               // PUT, SIGNAL, CREDIT, WAIT, EVENT_RECORD, EVENT_WAIT
  int64_t value = 0;                // increment (PUT/SIGNAL/CREDIT) or target base (WAIT/EVENT)
  int64_t per_call = 0;             // target/record slope in seq
  float alpha = 1.0f;               // LAND, and a SUM into the output
  bool accumulate = false;          // LAND, and a SUM into the output
  bool multicast = false;           // COPY: descriptors form identical-offset groups to all L
                                    // local ranks; an executor may use one multicast write
  DType cast_to = DType::kBF16;     // CAST: the item written (bf16 or fp16) from fp32
  int64_t target(int64_t seq) const { return value + per_call * seq; }
  double deadline_s = 0;            // WAIT/EVENT_WAIT: own deadline; 0 -> the executor's timeout
  int32_t rail_group = -1;          // SEND/RECV: the rendezvous group ([Note: two-sided rails])
};
// The rail peer of a SEND (its descriptors' destination rank) or RECV (their source rank).
int rail_peer(const Op& op);
inline bool is_rail_op(const Op& op) { return op.kind == OpKind::kSend || op.kind == OpKind::kRecv; }

// What the user may read from a user_output / landing once done_event reaches seq: `region`
// (1-D) holds the sum of `sources` (each a 1-D BufRef of the same call, with element dtypes),
// or, for a single source with dtype equal to region_dtype, a byte copy of it. No sources: zeros.
struct ExpectSource {
  BufRef src;
  DType dtype = DType::kBF16;
};
struct Expect {
  BufRef region;
  DType region_dtype = DType::kBF16;
  std::vector<ExpectSource> sources;
};

// Arena region offsets/sizes (identical on every rank); counters live in region "counters".
struct ArenaSpec {
  int64_t offset[kNumBufKinds] = {};
  int64_t bytes[kNumBufKinds] = {};
  int64_t counters_offset = 0;
  int64_t counters_bytes = 0;
  int64_t total = 0;
};
// Layout from plan.memory.arena when the planner provides it, otherwise a fallback layout
// with the same region names and order (ring slots NS each, resident S, stage per plan.ag, RS
// regions per plan.rs).
ArenaSpec arena_spec_for(const Plan& plan, int num_counters);
// The arena of a pulled TIDE-AG ([Note: pulled arena] in tide/plan.h: pull_arena): its stage (or
// resident region) and `num_counters` counters; the other regions at offset 0 with 0 bytes.
ArenaSpec pull_arena_spec_for(const Plan& plan, int num_counters);

// The collective a program (and a session's call) runs; the expert lane is TIDE-RS for an
// L_sub = 1 subgroup (App. F), whose programs carry Collective::kReduceScatter.
enum class Collective : uint8_t { kAllGather = 0, kReduceScatter = 1, kReduceScatterExpert = 2 };
constexpr int kNumCollectives = 3;
const char* collective_name(Collective c);  // "all_gather", "reduce_scatter", "reduce_scatter_expert"

// How a program reaches other nodes ([Note: two-sided rails] below): one-sided, by pointer into
// their arenas (PUT + SIGNAL; the virtual clusters, one host), or two-sided, through the rail
// transport's send/recv only (programs lowered by lower_two_sided; another node's arena is never
// mapped). The IR mark of a program (Program::rails) and, through ExecutorOptions::rails, how an
// executor reaches other nodes.
enum class Rails : uint8_t { kOneSided = 0, kTwoSided = 1 };
const char* rails_name(Rails r);                                        // "one_sided", "two_sided"
Rails parse_rails(const std::string& name, const std::string& where);  // PlanError naming `where`

struct Program {
  int version = kProgramIrVersion;
  Collective collective = Collective::kAllGather;
  int rank = 0;
  Topology topo;
  uint64_t plan_hash = 0;
  int32_t group = 0;                  // call identity: (group, seq) must agree on every rank
  std::vector<std::string> streams;   // stream names; Op::stream indexes this
  std::vector<Op> ops;                // issue order; per-stream order = order here
  ArenaSpec arena;
  int num_counters = 0;
  std::vector<std::string> counter_names;  // for messages, size num_counters
  int release_event = -1;             // own counter index: user_inputs rewritable at >= seq
  int done_event = -1;                // own counter index: user_outputs consumable at >= seq
  std::vector<BufRef> user_inputs;
  std::vector<BufRef> user_outputs;
  std::vector<Expect> expects;        // checked by the checker when done_event is reached
  // Bound user buffer sizes (bytes) by kind and index, so executors and the checker can bound
  // every access: user_buffer_bytes[kind][index + 1] (index -1 -> slot 0).
  std::vector<std::vector<int64_t>> user_buffer_bytes = std::vector<std::vector<int64_t>>(4);
  int32_t sum_ctas = 0;               // CTA budget of every SUM op (0: the executor's default)
  int32_t land_ctas = 0;              // CTA budget of every LAND op (0: the executor's default)
  Rails rails = Rails::kOneSided;     // kTwoSided: cross-node only through SEND/RECV (lower_two_sided)
};

// The end of the rendezvous group whose first op is pr.ops[stream_ops[k]] (a group's SEND/RECV ops
// are adjacent on their stream): what the checker and every executor take as one group.
size_t rail_group_end(const Program& pr, const std::vector<int>& stream_ops, size_t k);

// [Note: generated programs] A program set too large to hold (e.g. TIDE-RS at 1024 x 8: ~50K
// ops per rank) can be generated while it runs: the Program is then a header (streams, counters,
// arena, user buffers; no ops, no expects) and a ProgramGenerator yields each stream's ops in steps,
// in stream order, exactly the ops the built program holds for that stream. Only the CPU
// executor runs such calls (threads mode); the checker and the CUDA executor need built ops.
// An op's index in messages is then its position in its stream.
class ProgramGenerator {
 public:
  virtual ~ProgramGenerator() = default;
  virtual int steps(int rank, int stream) const = 0;
  // Appends step `step` of `stream` of rank `rank`'s program to `out`.
  virtual void emit(int rank, int stream, int step, std::vector<Op>& out) const = 0;
  // The rank (and its stream) whose ops bump `counter` (single producer), for timeout messages
  // without op tables; -1 when unknown.
  virtual int producer(const CounterRef& counter, int* stream) const {
    (void)counter;
    *stream = -1;
    return -1;
  }
};

// One call of a program on one rank: the collective order is the order of these per rank.
struct Call {
  const Program* program = nullptr;
  int64_t seq = 1;
  const ProgramGenerator* generator = nullptr;  // set: `program` is a header, its ops come from it
};

// ---------------------------------------------------------------------------------------------
// TIDE-AG program builder                                        [csrc/program/ag_program.cc]
// ---------------------------------------------------------------------------------------------
struct AgCallOptions {
  uint32_t struct_size = sizeof(AgCallOptions);
  int ring_slot = 0;          // landing = ring slot (group g uses g mod 2)
  bool resident = true;       // read shards from the adopted resident region (no cast only)
  bool multicast = false;     // mark local pushes/scatters multicast-capable
  bool expert_lane = false;   // L_sub = 1 lane: recursive doubling landing to landing, no stage
  int32_t group = 0;
  int64_t head_bytes = 0;     // per-round head bytes; 0 -> plan.opt.ag_head_bytes
  bool with_expects = true;   // fill Program::expects (N*P entries; off for large executor runs)
  // [Note: pull landing] Each rank lands the group in its own user buffers kLanding[p] (D_p rows,
  // unpadded) by pulling (a COPY reading a local peer's arena) instead of peers pushing into its
  // arena landing: for faces whose landing is not arena memory (XLA's results, FSDP2's unsharded
  // parameters). One node (M = 1): every local peer's staged (a cast) or resident shard. Across
  // nodes (M > 1, a cast only): the push program's paced Bruck rounds into the stage, and each
  // rank pulls every local peer's slot 0 and, once it arrived, each round's area ([Note: pull
  // landing across nodes], ag_program.cc). Not with the expert lane or multicast.
  bool pull_landing = false;
};
std::vector<Program> build_ag_programs(const Plan& plan, const AgCallOptions& opt);
Program build_ag_program(const Plan& plan, const AgCallOptions& opt, int rank);

// Scatter descriptor statistics measured from a built program (to compare with plan.ag).
struct AgProgramStats {
  int64_t scatter_descriptors = 0;  // per local destination (multicast counts once)
  int64_t put_ops = 0;
  int64_t ops = 0;
};
AgProgramStats ag_program_stats(const Program& prog);

// ---------------------------------------------------------------------------------------------
// Two-sided rail lowering                                                [csrc/program/rails.cc]
// ---------------------------------------------------------------------------------------------
// Rewrites a one-sided program set (one Program per group rank, as built) into the two-sided form
// of [Note: two-sided rails] and marks every program Rails::kTwoSided. Every program gets the same
// streams and num_counters. A set without cross-node transfers (M = 1) only gets the mark. Throws
// PlanError naming rank and op for a program it cannot lower (a cross-node COPY, a remote wait,
// a cross-node wait that guards no rail transfer).
void lower_two_sided(std::vector<Program>& progs);

// What one two-sided program posts on its rail per call: rendezvous groups (one
// ncclGroupStart/End each), SEND and RECV ops (one per peer and group), the 1-D messages they
// carry (descriptors) and the bytes sent. All zero for a one-sided program.
struct RailStats {
  int64_t groups = 0, sends = 0, recvs = 0, send_messages = 0, send_bytes = 0;
};
RailStats rail_stats(const Program& prog);

// ---------------------------------------------------------------------------------------------
// Static checker (csrc/program/checker.cc): proves I1-I4 for one collective order.
// ---------------------------------------------------------------------------------------------
struct CheckReport {
  bool ok = true;
  std::vector<std::string> errors;  // each names invariant, rank, op index + kind, seq, region
  int64_t ops_simulated = 0;
};
// per_rank[r] is rank r's calls in issue order. Simulates every rank's streams (any
// interleaving allowed by waits), tracks happens-before exactly (vector clocks over streams),
// data provenance (which contributor's bytes are where), and reports:
//   I1 expects not met at done_event (missing, stale, misplaced or double-counted bytes), or a
//      landing byte (ring0/ring1/landing) written twice by COPY/PUT/CAST in one call;
//   I2 a user_input read not ordered before release_event (the user's rewrite);
//   I3 any two conflicting accesses (write/write, write/read) not ordered by happens-before,
//      including arena reuse across calls and writes into user_outputs before consumption;
//   I4 calls in a different (group, seq, plan) order on some rank, a counter with several
//      producing streams, or a deadlock (a wait whose producer never comes).
//   R  two-sided rails: a SEND without its RECV (a dropped receive) or the reverse, a size
//      mismatch, transfers matched out of order (groups issued in different orders), a rendezvous
//      group meeting two groups of one peer (a group split in two); a rendezvous deadlock is I4.
// Structural rule violations (the push rule, out-of-bounds refs; in a two-sided program any
// cross-node access outside SEND/RECV) are reported as well.
CheckReport check_programs(const std::vector<std::vector<Call>>& per_rank, int max_errors = 8);
// Convenience: every rank runs `calls` calls of its program with seq 1..calls.
CheckReport check_program_set(const std::vector<Program>& progs, int calls = 2);

// ---------------------------------------------------------------------------------------------
// Fault injection (csrc/program/faults.cc; tests only): mutate programs.
// ---------------------------------------------------------------------------------------------
enum class FaultKind : uint8_t {
  kDropCredit = 0,     // remove a CREDIT
  kDropWait = 1,       // remove a WAIT (tag-selectable)
  kDropFence = 2,      // remove the completion fence (done waits) / an EVENT_WAIT
  kReorderCalls = 3,   // swap two calls on one rank (applied to a call list)
  kEarlyReuse = 4,     // a PUT/COPY writes a stage/outbox/inbox block still in use
  kSkipZero = 5,       // remove a ZERO
  kOtherPlan = 6,      // one rank runs a program of a different plan (applied to a program set)
  kStalledPeer = 7,    // executor-level: a rank pauses (ExecFaults)
  kDeadPeer = 8,       // executor-level: a rank stops
  // Two-sided programs (lower_two_sided):
  kDropRecv = 9,       // remove a RECV (its SEND finds no receive)
  kSplitRailGroup = 10,  // the first rail group with two transfers to one peer is issued as two
  kSwapRailGroups = 11,  // two consecutive rail groups issued in the other order on one rank
  kRailSizeMismatch = 12,  // a RECV expects fewer bytes than its SEND carries
};
const char* fault_kind_name(FaultKind k);
// Mutates progs[rank] in place; returns false when the program has no op the fault applies to.
// `tag` narrows kDropWait/kDropFence to ops with that tag (kNone: first applicable).
// `round` (not kAnyRound) narrows them further to ops of that round (Op::round; -1: none).
constexpr int32_t kAnyRound = INT32_MIN;
bool inject_fault(std::vector<Program>& progs, FaultKind kind, int rank, OpTag tag = OpTag::kNone,
                  int32_t round = kAnyRound);

}  // namespace tide
