// TIDE-RS schedule (Section 4): sub-slices and their segment table, Level-1 ownership and
// coalesced strided pushes, Latin-square waves, buffer generations, stale-block zeroing sets,
// own-node spares, network rounds and outbox depth (Eq. 9).
#include <algorithm>

#include "tide/plan.h"

namespace tide {

namespace {

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
int64_t ceil_div(int64_t x, int64_t a) { return (x + a - 1) / a; }

// Segment table: the parameter pieces of every (pass, sub-slice). Parameters are contiguous in
// the per-rank output (o32_p ascending), so one sweep per sub-slice suffices.
// A direct schedule has one span, the whole output: subslices[0] = [0, E).
void build_segments(RsSchedule& rs, const GroupLayout& layout, int64_t E) {
  rs.segments.clear();
  rs.subslices.clear();
  size_t first_param = 0;
  const int spans = rs.direct ? 1 : rs.L;
  for (int pass = 0; pass < rs.n_part; ++pass) {
    first_param = 0;
    for (int s = 0; s < spans; ++s) {
      RsSubslice sub;
      sub.pass = pass;
      sub.s = s;
      const int64_t cap = rs.direct ? E : rs.E_subslice;
      const int64_t cap_end = std::min(E, (s + 1) * cap);
      sub.out_begin = std::min(cap_end, s * cap + pass * rs.E_sub);
      const int64_t end = std::min(cap_end, sub.out_begin + (rs.direct ? E : rs.E_sub));
      sub.length = end - sub.out_begin;
      sub.seg_begin = static_cast<int>(rs.segments.size());
      while (first_param < layout.params.size() &&
             layout.params[first_param].o32 + layout.params[first_param].e <= sub.out_begin)
        ++first_param;
      for (size_t p = first_param; p < layout.params.size() && sub.length > 0; ++p) {
        const ParamLayout& pl = layout.params[p];
        if (pl.o32 >= end) break;
        const int64_t a = std::max(sub.out_begin, pl.o32);
        const int64_t b = std::min(end, pl.o32 + pl.e);
        if (a >= b) continue;
        RsSegment seg;
        seg.param = static_cast<int>(p);
        seg.param_offset = a - pl.o32;
        seg.out_offset = a;
        seg.sub_offset = a - sub.out_begin;
        seg.length = b - a;
        rs.segments.push_back(seg);
      }
      sub.seg_end = static_cast<int>(rs.segments.size());
      rs.subslices.push_back(sub);
    }
  }
}

// Calls f(const RsL1Copy&) for every Level-1 push of `rank`, in issue order. A push covers the
// destination rows l = 0..L-1 of node t whose source lies below D_p; rows are consecutive ranks
// (pitch e_p = R_p*K_p in G_p, E_chunk in staging), so one strided copy covers the fully valid
// rows, one short tail the final padded row, and rows wholly past D_p are never copied: the sum
// treats them as zero (valid extents), which is what FSDP2's zero padding contributes.
// for_each_level1_copy_of: the pushes of one unit (c, pass, owner j, chunk) of `rank`.
template <typename F>
void for_each_level1_copy_of(const GroupLayout& layout, const RsSchedule& rs, int rank, int c, int pass,
                             int j, int chunk, F&& f) {
  // Direct (M = 1): the destination rows are owner j's own, one row per segment piece.
  const int M = rs.M, L = rs.rows_for_dest();
  const int n = rank / rs.L;
  const int64_t b = rs.b_grad;
  const int t = (n + c) % M;
  const int s = rs.direct ? 0 : subslice_of(j, c, M, rs.L);
  const RsSubslice& sub = rs.direct ? rs.subslices[0] : rs.subslice(pass, s);
  const int first = rs.direct ? j : t * rs.L;  // rank of destination row 0
  const int64_t col0 = chunk * rs.E_chunk, col1 = col0 + rs.E_chunk;
  for (int si = sub.seg_begin; si < sub.seg_end; ++si) {
    const RsSegment& seg = rs.segments[si];
    const int64_t x0 = std::max(col0, seg.sub_offset);
    const int64_t x1 = std::min(col1, seg.sub_offset + seg.length);
    if (x0 >= x1) continue;
    const ParamLayout& pl = layout.params[seg.param];
    const int64_t po = seg.param_offset + (x0 - seg.sub_offset);
    const int64_t w = x1 - x0;
    int l_full = 0;
    while (l_full < L && layout.valid_rows(seg.param, first + l_full) * pl.K >= po + w)
      ++l_full;
    RsL1Copy cp;
    cp.c = c; cp.t = t; cp.owner = j; cp.pass = pass; cp.s = s; cp.chunk = chunk;
    cp.copy.param = seg.param;
    cp.copy.src_pitch = pl.e * b;
    cp.copy.dst_pitch = rs.E_chunk * b;
    if (l_full > 0) {
      cp.copy.src_offset = (static_cast<int64_t>(first) * pl.e + po) * b;
      cp.copy.dst_offset = (x0 - col0) * b;
      cp.copy.width = w * b;
      cp.copy.height = l_full;
      cp.tail = false;
      f(cp);
    }
    if (l_full < L) {
      const int64_t valid = layout.valid_rows(seg.param, first + l_full) * pl.K;
      if (valid > po) {
        cp.copy.src_offset = ((static_cast<int64_t>(first) + l_full) * pl.e + po) * b;
        cp.copy.dst_offset = (l_full * rs.E_chunk + x0 - col0) * b;
        cp.copy.width = (valid - po) * b;
        cp.copy.height = 1;
        cp.tail = true;
        f(cp);
      }
    }
  }
}

template <typename F>
void for_each_level1_copy(const GroupLayout& layout, const RsSchedule& rs, int rank, F&& f) {
  const int M = rs.M, L = rs.L;
  const int i = rank % L;
  for (int c = rs.direct ? M : 1; c <= M; ++c)
    for (int pass = 0; pass < rs.n_part; ++pass)
      for (int k = 1; k < L; ++k)  // the owner reads its own part in place: no step k = 0
        for (int chunk = 0; chunk < rs.n_chunks; ++chunk)
          for_each_level1_copy_of(layout, rs, rank, c, pass, rs_push_owner(i, k, L), chunk, f);
}

}  // namespace

void build_rs_waves(RsSchedule& rs, int M, int L, int w_wave, int n_part) {
  rs.M = M;
  rs.L = L;
  rs.w_wave = w_wave;
  rs.n_part = n_part;
  rs.waves = static_cast<int>(ceil_div(M, w_wave));
  rs.n_par = rs.waves > 1 ? 2 : 1;
  rs.d_rem = static_cast<int64_t>(n_part) * (M - 1);
  rs.n_spare = 1;
  rs.wave_list.clear();
  int g = 0;
  for (int pass = 0; pass < n_part; ++pass) {
    for (int w = 0; w < rs.waves; ++w, ++g) {
      RsWave wave;
      wave.pass = pass;
      wave.w = w;
      wave.gen = g % rs.n_par;
      wave.c_begin = w * w_wave + 1;
      wave.c_end = std::min(M, (w + 1) * w_wave) + 1;
      wave.own = wave.c_end == M + 1;
      // Contributor c fills block s = (j + c mod M) mod L on every destination GPU j (Eq. 7):
      // GPU j's mask is the wave's residue set {(c mod M) mod L} rotated by j.
      unsigned residues = 0;
      for (int c = wave.c_begin; c < wave.c_end; ++c) residues |= 1u << subslice_of(0, c, M, L);
      for (int j = 0; j < L; ++j)
        wave.write_mask[j] = uint8_t(((residues << j) | (residues >> (L - j))) & ((1u << L) - 1));
      rs.wave_list.push_back(wave);
    }
  }
  // Stale-block zeroing: blocks the previous wave on the same generation wrote and this one does
  // not. The inbox holds unknown bytes when a call starts (a fresh arena is not zeroed on a GPU,
  // and another group may have used the region), so the first wave on each generation zeroes
  // every block it does not write; full waves (len = L) write every block and zero nothing.
  const int T = static_cast<int>(rs.wave_list.size());
  const uint8_t all = static_cast<uint8_t>((1u << L) - 1);
  for (int gi = 0; gi < T; ++gi) {
    RsWave& cur = rs.wave_list[gi];
    const RsWave* prev = gi >= rs.n_par ? &rs.wave_list[gi - rs.n_par] : nullptr;
    for (int j = 0; j < L; ++j)
      cur.zero_mask[j] = uint8_t((prev ? prev->write_mask[j] : all) & ~cur.write_mask[j]);
  }
}

void build_rs_rounds(RsSchedule& rs, int k, Mode mode) {
  rs.k = k;
  rs.mode = mode;
  rs.rounds.clear();
  int eq9 = 0, prev_k = 0;
  for (size_t g = 0; g < rs.wave_list.size(); ++g) {
    RsWave& wave = rs.wave_list[g];
    wave.round_begin = static_cast<int>(rs.rounds.size());
    const int remote_end = std::min(wave.c_end, rs.M);  // c = M is the own node: no transfer
    for (int c = wave.c_begin; c < remote_end; c += k) {
      RsRound r;
      r.pass = wave.pass;
      r.wave = static_cast<int>(g);
      r.c_begin = c;
      r.c_end = std::min(remote_end, c + k);
      const int ki = r.c_end - r.c_begin;
      eq9 = std::max(eq9, ki + prev_k);
      prev_k = ki;
      rs.rounds.push_back(r);
    }
    wave.round_end = static_cast<int>(rs.rounds.size());
  }
  // Eq. 9: Slot-Reuse keeps two consecutive rounds of blocks. In-Place keeps a full outbox so
  // the reads of a one-pass call never wait for the NIC; with several passes it also needs the
  // two-round depth at the pass boundary.
  rs.n_out = mode == Mode::kSlotReuse ? eq9 : std::max(rs.M - 1, eq9);
}

std::vector<RsL1Copy> rs_level1_copies(const GroupLayout& layout, const RsSchedule& rs, int rank) {
  std::vector<RsL1Copy> out;
  for_each_level1_copy(layout, rs, rank, [&](const RsL1Copy& c) { out.push_back(c); });
  return out;
}

void rs_level1_unit_copies(const GroupLayout& layout, const RsSchedule& rs, int rank, int c, int pass,
                           int owner, int chunk, std::vector<RsL1Copy>& out) {
  for_each_level1_copy_of(layout, rs, rank, c, pass, owner, chunk,
                          [&](const RsL1Copy& cp) { out.push_back(cp); });
}

int64_t rs_scratch_bytes(const RsSchedule& rs) {
  return rs.n_stg * rs.stg_slot_bytes + 2ll * rs.n_out * rs.block_bytes +
         static_cast<int64_t>(rs.n_par) * rs.L * rs.block_bytes + 2ll * rs.n_spare * rs.block_bytes;
}

RsSchedule size_rs_schedule(const GroupLayout& layout, const Topology& topo, const Options& opt) {
  RsSchedule rs;
  const int M = topo.nodes, L = topo.gpus_per_node;
  const int w_wave = opt.w_wave ? opt.w_wave : L;
  TIDE_PLAN_CHECK(opt.k >= 1, "Options.k: the RS round width must be resolved to >= 1, got ", opt.k);
  TIDE_PLAN_CHECK(opt.n_part >= 1, "Options.n_part: the pass count must be resolved to >= 1, got ", opt.n_part);
  rs.direct = M == 1;  // [Note: direct Level 1]
  if (rs.direct) {
    rs.M = M; rs.L = L; rs.w_wave = w_wave; rs.n_part = 1; rs.waves = 0; rs.n_par = 0; rs.n_spare = 0;
    rs.k = opt.k; rs.mode = opt.mode; rs.n_out = 0; rs.d_rem = 0;
  } else {
    build_rs_waves(rs, M, L, w_wave, opt.n_part);
    build_rs_rounds(rs, opt.k, opt.mode);
  }

  const int64_t E = layout.E;
  rs.b_grad = static_cast<int>(layout.S_grad / std::max<int64_t>(1, E));
  // Passes split every sub-slice column-wise, so an element keeps its sub-slice s (hence its
  // owner and Latin-square position) for any n_part: passes change no operand grouping.
  rs.E_subslice = round_up(ceil_div(E, L), kSubsliceAlignElems);
  rs.E_sub = round_up(ceil_div(rs.E_subslice, rs.n_part), kSubsliceAlignElems);
  rs.E_stg = static_cast<int64_t>(L) * rs.E_sub;
  // A tiny group may leave later passes without live elements; they still run (zero blocks,
  // no landings), which keeps the plan valid for any n_part.
  rs.block_bytes = rs.direct ? 0 : 4 * static_cast<int64_t>(L) * rs.E_sub;
  rs.E_span = rs.direct ? std::max<int64_t>(E, 1) : rs.E_sub;
  rs.stg_rows = rs.direct ? 1 : L;
  rs.n_stg = opt.n_stg;
  int64_t chunk_bytes = opt.chunk_bytes;
  if (chunk_bytes == 0 && L > 1) {
    // The planner's chunk: n_stg slots of (L-1) peer areas of stg_rows rows within S_fp32.
    const int64_t per_piece = layout.S_fp32 / (static_cast<int64_t>(rs.n_stg) * (L - 1) * rs.stg_rows);
    chunk_bytes = std::max(kMinChunkBytes, per_piece);
  }
  rs.E_chunk = rs.E_span;
  if (chunk_bytes > 0) {
    // Never above chunk_bytes (the memory model sizes staging rows by min(E_span*b, chunk_bytes));
    // vector aligned when at least one vector fits; chunks balanced over the span.
    const int64_t elems = std::max<int64_t>(1, chunk_bytes / rs.b_grad);
    const int64_t cap = std::min(rs.E_span, elems >= kSubsliceAlignElems ? elems / kSubsliceAlignElems * kSubsliceAlignElems : elems);
    const int64_t n = ceil_div(rs.E_span, cap);
    const int64_t balanced = round_up(ceil_div(rs.E_span, n), kSubsliceAlignElems);
    rs.E_chunk = balanced <= cap ? balanced : cap;
  }
  const int64_t chunks = ceil_div(rs.E_span, rs.E_chunk);
  if (chunks > kMaxChunks) {
    // The smallest chunk_bytes with at most kMaxChunks chunks under the rounding above.
    int64_t need = ceil_div(rs.E_span, kMaxChunks);
    if (need >= kSubsliceAlignElems) need = round_up(need, kSubsliceAlignElems);
    throw PlanError(TIDE_STR_CAT("Options.chunk_bytes: ", chunk_bytes, " B splits each ",
                                 rs.direct ? "output" : "sub-slice pass", " of ", rs.E_span, " elements (n_part ",
                                 rs.n_part, ") into ", chunks, " chunks, above the limit of ", kMaxChunks,
                                 "; for this group chunk_bytes must be 0 (planner) or >= ", need * rs.b_grad));
  }
  rs.n_chunks = static_cast<int>(chunks);
  rs.stg_slot_bytes = static_cast<int64_t>(L - 1) * rs.stg_rows * rs.E_chunk * rs.b_grad;
  return rs;
}

RsSchedule build_rs_schedule(const GroupLayout& layout, const Topology& topo, const Options& opt) {
  RsSchedule rs = size_rs_schedule(layout, topo, opt);
  const int M = rs.M, L = rs.L;
  const int64_t E = layout.E;
  build_segments(rs, layout, E);

  // Descriptor counts: the worst local rank; every node pushes to the same set of destination
  // nodes, so node 0's ranks cover every (t, owner) pattern up to the rotation by c.
  const int64_t P = layout.P;
  rs.l1_coalesced_formula = static_cast<int64_t>(L - 1) * P * M;
  rs.l1_flat_descriptors_per_rank = rs.l1_coalesced_formula * (rs.direct ? 1 : L);
  for (int l = 0; l < L; ++l) {
    int64_t all = 0, tails = 0;
    for_each_level1_copy(layout, rs, l, [&](const RsL1Copy& c) {
      ++all;
      tails += c.tail;
    });
    if (all > rs.l1_descriptors_per_rank) {
      rs.l1_descriptors_per_rank = all;
      rs.l1_tail_descriptors_per_rank = tails;
    }
  }
  return rs;
}

}  // namespace tide
