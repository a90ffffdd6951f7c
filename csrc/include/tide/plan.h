// TIDE plan layer: everything static about one FSDP2 parameter group on one topology.
//
// Contract
//   - Pure C++17, no CUDA, no allocation after make_plan() returns; a Plan is immutable.
//   - make_plan() validates every input and throws tide::PlanError naming the field, parameter
//     or option at fault. A plan that is returned is collision-free and stale-block-free
//     (Prop. 4.1, App. D) or make_plan() threw.
//   - Identical (signature, topology, options) give an identical Plan and Plan::hash on every
//     rank; ranks agree on plans by comparing hashes.
//   - Notation follows the TIDE paper (Table 2): M nodes, L GPUs per node, N = M*L ranks,
//     node-major rank r = n*L + l; parameter p has (D_p, K_p), R_p = ceil(D_p/N) padded rows,
//     shard bytes s_p = R_p*K_p*b_ag, prefix offset o_p, packed shard S = sum s_p.
//
// Ownership of sections (one file each, so work on them does not collide):
//   layout.cc       — GroupLayout (Eqs. 2-3), input validation          [layout]
//   ag_schedule.cc  — AgSchedule: Bruck rounds, stage slots, descriptors  [TIDE-AG]
//   rs_schedule.cc  — RsSchedule: sub-slices, Latin square, waves, ...    [TIDE-RS]
//   validator.cc    — per-wave inbox bitmask validation, validate_all     [TIDE-RS]
//   memory.cc       — memory model (Eqs. 10-12), arena layout             [memory]
//   solver.cc       — sizing solver (Eqs. 13-14, App. G), Eq. 1 helper    [solver]
//   plan.cc         — make_plan() composition and Plan::hash
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tide/errors.h"

namespace tide {

// ---------------------------------------------------------------------------------------------
// Basic vocabulary
// ---------------------------------------------------------------------------------------------
// kU8: a 1-byte item an all-gather moves without arithmetic (FSDP2's FP8 all-gather gathers its
// float8 data as uint8; "float8_e4m3fn" and "float8_e5m2" name the same item). Accepted as the
// AG and shard dtype of a plan without a cast; never a gradient, SUM term or cast operand
// ([Note: byte items] in layout.cc).
enum class DType : uint8_t { kBF16 = 0, kFP16 = 1, kFP32 = 2, kU8 = 3 };
int dtype_size(DType t);
const char* dtype_name(DType t);
DType parse_dtype(const std::string& name, const char* field);  // throws PlanError naming field

enum class Mode : uint8_t { kInPlace = 0, kSlotReuse = 1 };
const char* mode_name(Mode m);
Mode parse_mode(const std::string& name);

constexpr int kMaxGpusPerNode = 8;   // L <= 8 (one NVSwitch domain)
constexpr int kMaxNodes = 1 << 16;   // M: far beyond any deployment; keeps N*S in int64
constexpr int kMaxParams = 256;      // P > 256 falls back to stock collectives
constexpr int kVectorElems = 4;      // fp32 elements per 16-byte vector (E_sub alignment)
// Sub-slice capacity alignment: 16 bytes of the narrowest staged type (bf16), so staging rows
// (E_sub bf16) and outbox/inbox rows (E_sub fp32) both start on 16-byte vectors. Aligning to
// kVectorElems alone left bf16 staging rows 8-byte aligned, off the SUM kernel's vector path.
constexpr int kSubsliceAlignElems = 8;

struct Topology {
  int nodes = 1;          // M
  int gpus_per_node = 1;  // L
  int world() const { return nodes * gpus_per_node; }  // N
  int node_of(int r) const { return r / gpus_per_node; }
  int local_of(int r) const { return r % gpus_per_node; }
  int rank(int n, int l) const { return n * gpus_per_node + l; }
};

struct ParamSpec {
  std::string name;            // for messages only
  std::vector<int64_t> shape;  // unsharded shape; sharded along dim 0
};

struct GroupSignature {
  std::vector<ParamSpec> params;
  DType ag_dtype = DType::kBF16;     // all-gather item type (b_ag)
  DType grad_dtype = DType::kBF16;   // gradient item type (b_grad)
  DType shard_dtype = DType::kBF16;  // sharded (master) dtype; != ag_dtype means the AG casts
                                     // into the first receive-stage slot (mixed precision)
  bool needs_cast() const { return shard_dtype != ag_dtype; }
};

// Versioned (struct_size first) so it can cross a C boundary later; normalised by make_plan().
struct Options {
  uint32_t struct_size = sizeof(Options);
  Mode mode = Mode::kInPlace;
  int w_wave = 0;        // W_wave, contributors per wave; 0 -> L
  int k = 0;             // max concurrent rail transfers per round; 0 -> solver
  int n_part = 0;        // sub-slice passes per reduce-scatter; 0 -> planner (rs_sizing)
  int n_stg = 2;         // local bf16 staging slots
  int64_t chunk_bytes = 0;  // RS staging chunk (bytes of one staged row piece); 0 -> planner
  int sum_ctas = 0;      // C_sum; 0 -> solver
  int land_ctas = 0;     // C_mc; 0 -> solver
  int64_t ag_head_bytes = 8ll << 20;  // total head bytes of a paced AG round (head/tail split)
};

// Option ranges, checked by validate_inputs (and listed in docs/options.md's table). Each bound
// keeps the plan's tables and the programs built from it small; none limits a useful plan.
//   n_part <= kMaxPasses: the planner needs at most kMaxAutoPasses (Fig. 10b); each pass adds
//     M-1 remote blocks and their rounds per call while the staging it saves shrinks as 1/n_part,
//     so 4x the planner's largest count is already far past any gain. App. D's exhaustive check
//     covers 2..4 (validate_all); validate_rs checks any given count.
//   n_stg <= kMaxStagingSlots: two slots already overlap pushes with sums (Section 4.1); at 16,
//     staging alone is 64 output blocks at L = 8, bf16 (Eq. 10's n_stg*L*b_grad/4), three times
//     the planner's whole RS scratch ceiling (kRsScratchBlocks).
//   k <= kMaxRoundWidth: the widths validate_all enumerates (App. D); k beyond W_wave changes no
//     round (k_eff = min(k, W_wave)).
//   sum_ctas, land_ctas <= kMaxCtas: the executors' CTA ceiling (ExecutorOptions' cast_ctas and
//     zero_ctas share it); Eqs. 13-14 give single digits.
//   chunk_bytes: 0 (planner) or >= one gradient element, and no more than kMaxChunks chunks per
//     Level-1 span (programs hold ops per chunk: n_part*M*n_chunks Level-1 units per call).
//   The arena (MemoryModel::arena_bytes) stays within kMaxArenaBytes per rank: 1 TiB, beyond any
//     accelerator's memory, so a plan past it is a mistake in the inputs, refused naming the
//     region that makes it large.
constexpr int kMaxPasses = 16;
constexpr int kMaxStagingSlots = 16;
constexpr int kMaxRoundWidth = 32;
constexpr int kMaxCtas = 4096;
constexpr int64_t kMaxChunks = 1024;
constexpr int64_t kMaxArenaBytes = 1ll << 40;

// ---------------------------------------------------------------------------------------------
// Layout (Section 2.1, Eqs. 2-3)                                                   [layout.cc]
// ---------------------------------------------------------------------------------------------
struct ParamLayout {
  int64_t D = 0;    // dim-0 extent
  int64_t K = 0;    // product of trailing dims
  int64_t R = 0;    // padded per-rank rows, ceil(D/N)
  int64_t s = 0;    // per-rank shard bytes in the AG dtype, R*K*b_ag
  int64_t o = 0;    // prefix byte offset in the packed shard
  int64_t e = 0;    // per-rank shard elements, R*K
  int64_t o32 = 0;  // prefix element offset in the per-rank fp32 RS output
};

struct GroupLayout {
  int P = 0;
  int N = 0;
  std::vector<ParamLayout> params;
  int64_t S = 0;          // packed per-rank shard bytes (AG dtype)
  int64_t S_grad = 0;     // packed per-rank gradient shard bytes (grad dtype)
  int64_t S_fp32 = 0;     // per-rank fp32 RS output bytes
  int64_t E = 0;          // per-rank output elements, sum R_p*K_p  (S_fp32 = 4E)
  int64_t B_pack = 0;     // FSDP2's packed fp32 RS input (Eq. 3), for comparison
  int64_t unsharded_bytes() const { return S * N; }  // NS

  // Landing(p, r) = o_p*N + r*s_p (Eq. 2): byte offset of rank r's shard of p in the group's
  // parameter-major unsharded buffer.
  int64_t landing(int p, int r) const { return params[p].o * N + r * params[p].s; }
  // Rows of I_{p,r} = [r*R_p, (r+1)*R_p) that lie below D_p (the rest are zero padding).
  int64_t valid_rows(int p, int r) const;
};

GroupLayout build_layout(const GroupSignature& sig, const Topology& topo);

// ---------------------------------------------------------------------------------------------
// A strided (2-D) copy: `height` rows of `width` bytes. Offsets are relative to the buffers the
// owning schedule names. Used by both schedules' descriptors.
// ---------------------------------------------------------------------------------------------
struct StridedCopy {
  int64_t src_offset = 0;
  int64_t src_pitch = 0;
  int64_t dst_offset = 0;
  int64_t dst_pitch = 0;
  int64_t width = 0;
  int64_t height = 1;
  int param = -1;
};

// ---------------------------------------------------------------------------------------------
// TIDE-AG schedule (Section 3)                                                 [ag_schedule.cc]
// ---------------------------------------------------------------------------------------------
struct AgSchedule {
  int rounds = 0;              // R = ceil(log2 M)
  std::vector<int> c;          // c_d = min(2^d, M - 2^d)
  int stage_slots = 0;         // M-1 (M with a cast)
  int64_t stage_bytes = 0;     // (M-1)S (MS with a cast)
  // Filled by ag_schedule.cc (TIDE-AG owner): descriptor tables and counts.
  int64_t descriptors_per_rank = 0;       // coalesced scatter descriptors, O(P log M) (max over nodes)
  int64_t flat_descriptors_per_rank = 0;  // one per (slot, param): O(MP)
  int last_round_groups = 0;              // the last round's slots split into <= 4 scatter groups
  int64_t local_push_descriptors = 0;     // P: own shard to every local landing (one multicast)
};

// Bruck peers on one rail (Section 3.1): in round d node n sends its first c_d stage slots to
// (n - 2^d) mod M and receives as many from (n + 2^d) mod M into slots [2^d, 2^d + c_d).
// Stage slot i of node n holds the shard of node (n + i) mod M on the same rail; slot 0 is the
// own shard (read in place, or the cast output in stage position 0 with a cast).
// R = ceil(log2 M) and c_d for any M (what build_ag_schedule uses).
void ag_bruck_rounds(int M, int* rounds, std::vector<int>* c);
inline int ag_send_peer(int n, int d, int M) { return ((n - (1 << d)) % M + M) % M; }
inline int ag_recv_peer(int n, int d, int M) { return (n + (1 << d)) % M; }
// Byte offset of stage slot i (i >= 1; i >= 0 with a cast) in the receive stage.
inline int64_t ag_stage_offset(int slot, int64_t S, bool cast) { return (cast ? slot : slot - 1) * S; }

// One scatter run: stage slots [first_slot, first_slot + slots) received in `round`, from
// consecutive rail-peer nodes (never across the mod-M wrap), so each parameter's rows form one
// strided copy (src pitch S, dst pitch L*s_p) when slots >= 4, else one copy per slot.
struct AgScatterRun {
  int round = 0;
  int first_slot = 0;
  int slots = 0;
};
constexpr int kAgMinStridedRun = 4;     // runs of >= 4 slots become one strided copy per param
constexpr int kAgLastRoundGroups = 4;   // the last round is split into <= 4 scatter groups
std::vector<AgScatterRun> ag_scatter_runs(const AgSchedule& ag, int M, int node);
inline int64_t ag_run_descriptors(const AgScatterRun& run, int P) {
  return run.slots >= kAgMinStridedRun ? P : static_cast<int64_t>(run.slots) * P;
}
int64_t ag_scatter_descriptors(const AgSchedule& ag, int M, int P, int node);
// Position-aware 2-slot ring (App. F): group g (execution order) lands in slot g mod 2, and
// each slot is sized for the groups assigned to it. Returns {slot0 bytes, slot1 bytes}.
std::vector<int64_t> ag_ring_slot_bytes(const std::vector<int64_t>& group_ns_bytes);

// ---------------------------------------------------------------------------------------------
// TIDE-RS schedule (Section 4)                                                 [rs_schedule.cc]
//
// Geometry. Sub-slice s covers the per-rank fp32 output elements [s*E_subslice, (s+1)*E_subslice)
// (clipped to E; the final live range may be shorter or empty) and crosses parameter boundaries.
// Pass p handles columns [p*E_sub, (p+1)*E_sub) of every sub-slice, so an element's sub-slice,
// owner and inbox position do not depend on n_part. A segment is the part of one (pass,
// sub-slice) piece inside one parameter. An outbox/inbox block holds one pass of a sub-slice for
// the L ranks of one destination node: L rows of E_sub fp32 (row l = destination local rank l),
// block_bytes = 4*L*E_sub. Arena: staging n_stg*stg_slot_bytes, outbox 2 banks x n_out blocks,
// inbox n_par x L blocks, spare 2 banks x n_spare blocks. Each GPU's inbox has L blocks per
// buffer generation; block s of destination GPU j receives contributor c when j = j(s, c) (Eq. 8).
// Level 1 stages the L-1 peers' contributions of one sub-slice in a staging slot of
// (L-1) peer areas x L rows x E_chunk grad elements (peer areas in local-rank order, owner skipped).
// ---------------------------------------------------------------------------------------------
struct RsSegment {
  int param = -1;
  int64_t param_offset = 0;  // element offset inside the per-rank shard of p, in [0, e_p)
  int64_t out_offset = 0;    // element offset in the per-rank fp32 output (= o32_p + param_offset)
  int64_t sub_offset = 0;    // column inside the pass's block row, in [0, E_sub)
  int64_t length = 0;        // elements
};

struct RsSubslice {
  int pass = 0;
  int s = 0;
  int64_t out_begin = 0;           // first per-rank output element
  int64_t length = 0;              // live elements, <= E_sub (0 when the pass is shorter)
  int seg_begin = 0, seg_end = 0;  // its segments: RsSchedule::segments[seg_begin, seg_end)
};

// One wave of one pass: contributors [c_begin, c_end) in send order (c = M, the own node, is the
// last contributor of the last wave of every pass).
struct RsWave {
  int pass = 0;
  int w = 0;    // wave index inside the pass, [0, W)
  int gen = 0;  // inbox buffer generation q (global wave index mod n_par)
  int c_begin = 1, c_end = 1;
  bool own = false;  // holds c = M: the own-node spare is copied into inbox block j of GPU j first
  int round_begin = 0, round_end = 0;  // its network rounds: RsSchedule::rounds[...]
  // Per destination GPU j: bit s set when inbox block s of generation `gen` receives a partial
  // in this wave (write_mask), or must be zeroed before this wave's puts because the previous
  // wave on the same generation wrote it and this wave does not (zero_mask; stale-block zeroing).
  // Each call starts from unknown inbox contents, so the first wave on a generation zeroes
  // every block it does not write.
  uint8_t write_mask[kMaxGpusPerNode] = {};
  uint8_t zero_mask[kMaxGpusPerNode] = {};
};

// One network round: up to k remote contributors [c_begin, c_end) of one wave. Remote destination
// block J (0-based over all passes: J = pass*(M-1) + c-1) uses outbox block J mod n_out of bank b.
struct RsRound {
  int pass = 0;
  int wave = 0;  // global wave index into RsSchedule::wave_list
  int c_begin = 1, c_end = 1;
};

// One coalesced Level-1 push: a pusher's contribution to `height` consecutive destination rows of
// one segment (chunk piece) of sub-slice s for destination node t. Offsets in bytes of the grad
// dtype: src relative to the pusher's gradient G_p, dst relative to the peer area of the owner's
// staging chunk (row-major L x E_chunk). height == 1 with a short width is a padded-row tail.
struct RsL1Copy {
  StridedCopy copy;
  int c = 0;          // send-order step (c = M: the own node)
  int t = 0;          // destination node
  int owner = 0;      // owner local rank j = j(s, c)
  int pass = 0, s = 0, chunk = 0;
  bool tail = false;
};

struct RsSchedule {
  // [Note: direct Level 1] With one node (M = 1) there is no Level 2: every local rank owns its
  // own output, the L-1 peers push its rows chunk by chunk into its staging, and its Level-1 SUM
  // writes the fp32 output directly (alpha and accumulate folded in). No waves, rounds, outbox,
  // inbox or spare; a chunk then spans the whole output (E_span = E) instead of a sub-slice.
  bool direct = false;
  int64_t E_span = 0;   // columns one Level-1 unit's chunks cover: E_sub, or E when direct
  int w_wave = 0;       // W_wave (resolved)
  int waves = 0;        // W = ceil(M / W_wave), waves per pass
  int n_par = 0;        // inbox buffer generations: 1 for a single wave, else 2
  int n_out = 0;        // outbox blocks per bank (Eq. 9; M-1 for one-pass In-Place)
  int n_part = 1;       // sub-slice passes
  int k = 0;            // resolved round width
  Mode mode = Mode::kInPlace;
  int64_t E_stg = 0;    // aligned per-rank staging span (elements) of one pass, L*E_sub
  int64_t E_sub = 0;    // sub-slice capacity of one pass (elements), vector aligned, >= ceil(E_stg/L)
  int64_t E_subslice = 0;  // sub-slice capacity over all passes, vector aligned, >= ceil(E/L)
  int64_t block_bytes = 0;  // outbox/inbox block: L rows of E_sub fp32
  int64_t E_chunk = 0;      // staged columns per staging chunk (E_sub without chunking)
  int n_chunks = 1;         // chunks per sub-slice, ceil(E_sub / E_chunk)
  int n_stg = 2;            // staging slots
  int b_grad = 2;           // gradient item size
  int64_t stg_slot_bytes = 0;  // one staging slot: (L-1) * rows * E_chunk * b_grad (rows: L, 1 direct)
  int stg_rows = 0;            // staged rows per peer area: L (one per destination rank), 1 direct
  int n_spare = 1;          // own-node spare blocks per bank (passes reuse it in turn)
  int64_t d_rem = 0;        // remote destination blocks per call, n_part*(M-1)
  int64_t l1_descriptors_per_rank = 0;       // coalesced Level-1 copies per call, with tails (max
                                             // over node 0's ranks; rs_level1_copies for any rank)
  int64_t l1_tail_descriptors_per_rank = 0;  // ... of which padded-row tails
  int64_t l1_flat_descriptors_per_rank = 0;  // (L-1)PML: one flat copy per destination row
  int64_t l1_coalesced_formula = 0;          // (L-1)PM: the paper's count without tails
  std::vector<RsSegment> segments;
  std::vector<RsSubslice> subslices;  // index pass*L + s
  std::vector<RsWave> wave_list;      // global order: pass-major, then w
  std::vector<RsRound> rounds;        // global order

  int M = 0, L = 0;  // topology the schedule was built for

  const RsSubslice& subslice(int pass, int s) const { return subslices[pass * L + s]; }
  int rows_for_dest() const { return direct ? 1 : L; }  // destination rows one Level-1 push covers
};

// The static shape of a schedule, without a parameter group (validate_all enumerates these):
// waves, generations, write/zero masks (build_rs_waves), rounds and outbox depth (build_rs_rounds).
void build_rs_waves(RsSchedule& rs, int M, int L, int w_wave, int n_part);
void build_rs_rounds(RsSchedule& rs, int k, Mode mode);
// The owner local rank i pushes to at push step k = 1..L-1 of a Level-1 unit: i+1, i+2, ... mod L.
// At each step the node's pushes form a permutation (every GPU sends to one owner and receives
// from one peer, the Latin-square pairing of §4.1), so no owner's inbound link or staging carries
// all L-1 peers at once. The builder and rs_level1_copies both walk owners in this order.
inline int rs_push_owner(int i, int k, int L) { return (i + k) % L; }
// Level-1 pushes of one rank i for one call (all passes): step c, pass, owner (rs_push_owner),
// chunk, segment. Their count is what l1_descriptors_per_rank reports for the worst rank.
std::vector<RsL1Copy> rs_level1_copies(const GroupLayout& layout, const RsSchedule& rs, int rank);
// The pushes of one Level-1 unit (c, pass, owner, chunk) of `rank`, in issue order, appended to
// `out` (the same copies rs_level1_copies lists for that unit).
void rs_level1_unit_copies(const GroupLayout& layout, const RsSchedule& rs, int rank, int c, int pass,
                           int owner, int chunk, std::vector<RsL1Copy>& out);

// Validator (Prop. 4.1, App. D)                                                    [validator.cc]
// check_* return "" when the schedule is valid, else why not; validate_rs throws that as PlanError.
std::string check_rs_waves(const RsSchedule& rs);   // collisions, stale blocks, generations
std::string check_rs_rounds(const RsSchedule& rs);  // rounds inside waves, <= k, Eq. 9 depth
struct ValidateAllResult {
  int64_t accepted = 0, rejected = 0;  // base plans (M, W_wave, k, me)
  std::vector<std::pair<int, int>> accepted_pairs, rejected_pairs;  // (M, W_wave)
  bool n_part_ok = true;               // n_part in {2,3,4} valid for every accepted base plan
  int64_t n_part_checked = 0;
  std::string first_n_part_failure;
};
// Every base plan with M in [min_nodes, max_nodes] (each M is independent: callers may split the
// range to report progress or stop between parts); min_nodes = max_nodes + 1 checks the arguments only.
ValidateAllResult validate_all(int gpus_per_node, int max_nodes, int min_nodes = 2);

// Sub-slice rotation (Eq. 7) and destination GPU (Eq. 8) of contributor index c (Eq. 6).
inline int subslice_of(int j, int c, int M, int L) { return (j + c % M) % L; }
inline int dest_gpu(int s, int c, int M, int L) { return ((s - c % M) % L + L) % L; }

// ---------------------------------------------------------------------------------------------
// Memory model (Section 5.4, Eqs. 10-12) and arena layout                          [memory.cc]
// ---------------------------------------------------------------------------------------------
struct ArenaRegion {
  std::string name;   // see MemoryModel::arena for the names
  int64_t offset = 0;
  int64_t bytes = 0;
};

constexpr int64_t kArenaAlign = 4096;          // every arena region starts on a 4 KiB boundary
constexpr int64_t kCounterBytes = 64ll << 10;  // "counters" region: signal/credit counters

// All byte counts are per rank. NS = N*S is the group's unsharded bytes in the AG dtype.
struct MemoryModel {
  int64_t ns_bytes = 0;               // NS
  // Temporary RS staging as laid out (Eq. 10's terms): staging + inbox + outbox + spares.
  int64_t staging_slot_bytes = 0;     // one local bf16 staging slot: (L-1)*L*E_sub*b_grad
  int64_t staging_bytes = 0;          // n_stg slots
  int64_t inbox_bytes = 0;            // n_par generations x L blocks
  int64_t outbox_bytes = 0;           // 2 banks x n_out blocks
  int64_t spare_bytes = 0;            // one own-node spare block per bank
  int64_t area_rs_bytes = 0;          // temporary RS staging (Eq. 10) as laid out
  double area_rs_ns = 0;              // ... in units of NS
  double area_rs_bound_ns = 0;        // Eq. 10 closed-form bound for this plan's n_out
  double area_inplace_bound_ns = 0;   // Eq. 11 (n_out = M-1)
  double area_slot_bound_ns = 0;      // Eq. 12 (n_out = 2k)
  // Live bytes during a layer's backward (Section 5.4).
  int64_t ring_bytes = 0;             // two AG ring slots, 2 NS
  int64_t stage_bytes = 0;            // AG receive stage, (M-1)S or MS with a cast
  int64_t prev_grad_bytes = 0;        // In-Place only: previous layer's gradients, N*S_grad
  int64_t live_tide_bytes = 0;        // ring + stage + area_rs + prev_grad
  double live_tide_ns = 0;            // TIDE's live bytes during a layer's backward, units of NS
  double live_tide_bound_ns = 0;      // (2 + 1/L) + Eq. 11/12 bound (+1 NS of grads for In-Place)
  int64_t live_fsdp2_bytes = 0;       // 2 NS + B_pack (unsharded, prefetched AG, fp32 RS input)
  double live_fsdp2_ns = 4.0;         // FSDP2's 4 NS (bf16)
  // Arena regions, in this order, names stable (executors look them up by name):
  //   ring0, ring1 (NS each), resident (S; only without a cast), stage, staging,
  //   outbox (2 banks), inbox (n_par generations x L blocks), spare (2 blocks), counters.
  // Within a region, blocks are block_bytes apart: outbox bank b block i at (b*n_out + i),
  // inbox generation g block j at (g*L + j), spare of bank b at b; staging slot t at
  // t*staging_slot_bytes.
  // (A TIDE-AG that pulls has an arena of its own: pull_arena below.)
  std::vector<ArenaRegion> arena;     // every region's offset and size
  int64_t arena_bytes = 0;
  const ArenaRegion& region(const std::string& name) const;  // throws Error naming `name`
};

// ---------------------------------------------------------------------------------------------
// Sizing solver (Eqs. 13-14, App. G)                                                [solver.cc]
// ---------------------------------------------------------------------------------------------
struct Calibration {
  double bw_nic = 47.5e9;    // B/s sustained per rail
  double bw_sum = 99e9;      // B/s per sum CTA (logical read + write)
  double bw_land = 21e9;     // B/s per landing CTA
  double bw_cap = 90e9;      // landing fabric ceiling
  double t_rnd = 1.3e-3;     // s, per-round wait overhead
  double gamma_skew = 1.5;
  double eta_tail = 0.05;
  int k_max = 4;
  double bw_push = 360e9;    // B/s copy-engine pushes arriving at one GPU from its L-1 peers
  double bw_hbm = 4.0e12;    // B/s device memory read + write (a single rank's sum, H200 ~4.2)
};

// The solver's choices; a nonzero Options field overrides the matching choice (flagged below),
// and the values here are the resolved ones the plan uses.
struct SolverResult {
  int k = 0;
  int sum_ctas = 0;
  int land_ctas = 0;
  int n_part = 1;
  double t_nic = 0;  // s, (M-1) S_fp32 / BW_NIC
  int rounds = 0;    // N_rounds(M-1, k, W_wave)
  bool k_given = false, sum_ctas_given = false, land_ctas_given = false;
};

// N_rounds(M-1, k, W_wave): network rounds of one reduce-scatter (App. G).
int n_rounds(int M, int k, int w_wave);

// Recoverable FSDP overhead fraction (Eq. 1), up to its proportionality constant.
double recoverable_overhead_fraction(double psi_total, double psi_active, double tokens_per_gpu);

// ---------------------------------------------------------------------------------------------
// The plan                                                                             [plan.cc]
// ---------------------------------------------------------------------------------------------
struct Plan {
  GroupSignature sig;
  Topology topo;
  Options opt;  // normalised: every 0 ("auto") resolved
  GroupLayout layout;
  AgSchedule ag;
  RsSchedule rs;
  MemoryModel memory;
  SolverResult solver;
  std::string rs_sizing;  // why the planner chose this pass count and chunk (tide plan prints it)
  uint64_t hash = 0;
};

Plan make_plan(const GroupSignature& sig, const Topology& topo, const Options& opt,
               const Calibration& cal = Calibration());

// Per-file builders composed by make_plan (declared here so each lives in its own file).
void validate_inputs(const GroupSignature& sig, const Topology& topo, const Options& opt);
// The signature's own checks (non-empty group, positive extents, addressable size at `world`
// ranks); validate_inputs runs them too.
void validate_signature(const GroupSignature& sig, int world);
// Every Calibration field in its range (solver.cc lists them), or PlanError naming the field.
void validate_calibration(const Calibration& cal);
// CTA counts are saturated at kMaxCtas.
SolverResult solve(const GroupLayout& layout, const Topology& topo, const Options& opt,
                   const Calibration& cal);
AgSchedule build_ag_schedule(const GroupLayout& layout, const GroupSignature& sig,
                             const Topology& topo, const Options& opt);
RsSchedule build_rs_schedule(const GroupLayout& layout, const Topology& topo, const Options& opt);
// The schedule's sizes only (waves, rounds, n_out, E_sub, blocks, chunks): no segment table or
// descriptor counts. What the planner compares candidate pass counts and chunks with.
RsSchedule size_rs_schedule(const GroupLayout& layout, const Topology& topo, const Options& opt);
// RS scratch bytes (staging + outbox + inbox + spare) a sized schedule lays out.
int64_t rs_scratch_bytes(const RsSchedule& rs);
// The planner's staging chunk (Options.chunk_bytes = 0): the largest whole-vector chunk whose
// n_stg slots fit in one output-sized block S_fp32, never below kMinChunkBytes per staged piece.
constexpr int64_t kMinChunkBytes = 256 << 10;
constexpr double kRsScratchBlocks = 21.0;  // RS scratch ceiling in output-sized blocks (Fig. 10b)
constexpr int kMaxAutoPasses = 4;
void validate_rs(const RsSchedule& rs, const Topology& topo, const Options& opt);  // PlanError
MemoryModel build_memory(const Plan& plan);
// [Note: pulled arena] The arena of a TIDE-AG session that pulls into its callers' landings
// ([Note: pull landing] in tide/program.h; tide_xla's all-gathers with a cast): the regions its
// programs address and nothing else, in this order, each 4 KiB aligned: resident (S; only without
// a cast, where the peers pull the adopted shards), stage (plan.ag.stage_bytes: slot 0 holds the
// cast shard, across nodes the Bruck rounds fill the rest), then counters, 8 bytes for each of
// `num_counters` (its programs' counters on the rails in use: program_counters in
// tide/session.h; the two-sided lowering adds some). The arena ends with its counters. No ring
// slots (the landing is the caller's buffer) and no TIDE-RS regions: MemoryModel::arena without
// its 2 NS of ring slots and Area_RS, and with a counters region of exactly its counters.
std::vector<ArenaRegion> pull_arena(const Plan& plan, int num_counters);
// The memory model's live bytes during a layer's backward, less the RS scratch (ring slots, AG
// stage, In-Place's previous gradients), and FSDP2's (2 NS + B_pack): what build_memory and the
// planner's pass count both use. Needs plan.layout, plan.ag and plan.opt.mode.
int64_t live_bytes_besides_rs(const Plan& plan);
int64_t live_fsdp2_bytes(const GroupLayout& layout);

}  // namespace tide
