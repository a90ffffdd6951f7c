// Validator (Prop. 4.1, App. D): simulates the per-wave inbox block bitmask of every destination
// GPU, and the exhaustive regression over base plans (M, W_wave, k, me).
//
// The masks do not depend on the destination node m: contributor c lands in block s of GPU
// j(s, c) = (s - c mod M) mod L on every node, so one simulation per schedule covers all m.
#include <algorithm>
#include <cstring>

#include "tide/plan.h"

namespace tide {

namespace {

std::string where(const RsSchedule& rs, const RsWave& w) {
  return TIDE_STR_CAT("M=", rs.M, ", L=", rs.L, ", W_wave=", rs.w_wave, ": wave ", w.w,
                      rs.n_part > 1 ? TIDE_STR_CAT(" of pass ", w.pass) : std::string(),
                      " (contributors ", w.c_begin, "..", w.c_end - 1, ", generation ", w.gen, ")");
}

uint64_t pack_masks(const uint8_t* m) {
  uint64_t v = 0;
  std::memcpy(&v, m, kMaxGpusPerNode);
  return v;
}

int first_byte(uint64_t v) {
  int j = 0;
  while (!((v >> (8 * j)) & 0xffu)) ++j;
  return j;
}

}  // namespace

std::string check_rs_waves(const RsSchedule& rs) {
  const int M = rs.M, L = rs.L;
  if (M < 1 || L < 1 || L > kMaxGpusPerNode)
    return TIDE_STR_CAT("RS schedule: bad topology M=", M, ", L=", L);
  if (rs.w_wave < 1 || rs.w_wave > L)
    return TIDE_STR_CAT("Options.w_wave: W_wave=", rs.w_wave, " must be in [1, L=", L, "]");
  const int W = (M + rs.w_wave - 1) / rs.w_wave;
  if (rs.waves != W || rs.n_par != (W > 1 ? 2 : 1) ||
      rs.wave_list.size() != static_cast<size_t>(W) * rs.n_part)
    return TIDE_STR_CAT("RS schedule: M=", M, ", W_wave=", rs.w_wave, " needs W=", W,
                        " waves per pass and ", W > 1 ? 2 : 1, " buffer generation(s); the "
                        "schedule has ", rs.waves, " waves, ", rs.n_par, " generation(s), ",
                        rs.wave_list.size(), " waves in all over ", rs.n_part, " pass(es)");
  // 1. Waves partition c = 1..M in increasing order; generations alternate.
  for (size_t g = 0; g < rs.wave_list.size(); ++g) {
    const RsWave& w = rs.wave_list[g];
    const int wi = static_cast<int>(g) % W;
    const int c0 = wi * rs.w_wave + 1, c1 = std::min(M, (wi + 1) * rs.w_wave) + 1;
    if (w.pass != static_cast<int>(g) / W || w.w != wi || w.c_begin != c0 || w.c_end != c1)
      return TIDE_STR_CAT(where(rs, w), ": expected contributors ", c0, "..", c1 - 1,
                          " (increasing partition into waves of width W_wave)");
    if (w.own != (c1 == M + 1))
      return TIDE_STR_CAT(where(rs, w), ": the own node c=M belongs to the last wave only");
    if (w.gen != static_cast<int>(g) % rs.n_par)
      return TIDE_STR_CAT(where(rs, w), ": generation must be q = ", g % rs.n_par,
                          " (consecutive waves alternate the inbox double buffer)");
  }
  // 2. Collision freedom (Prop. 4.1): contributor c fills block (j + c mod M) mod L of GPU j, so
  // two contributors of a wave collide on some (j, s) exactly when their residues (c mod M) mod L
  // agree. The per-GPU block masks are then the residue set rotated by j.
  for (const RsWave& w : rs.wave_list) {
    unsigned residues = 0;
    int who[kMaxGpusPerNode];
    for (int c = w.c_begin; c < w.c_end; ++c) {
      const int r = (c % M) % L;
      if (residues & (1u << r)) {
        const int s = r, j = dest_gpu(s, c, M, L);
        return TIDE_STR_CAT(where(rs, w), ": contributors c=", who[r], " and c=", c,
                            " both land in inbox block s=", s, " of destination GPU j=", j,
                            " ((c mod M) mod L = ", r, " for both; Eq. 8)",
                            L % rs.w_wave ? TIDE_STR_CAT("; W_wave=", rs.w_wave,
                                                         " does not divide L=", L)
                                          : std::string(),
                            "; the plan is rejected");
      }
      residues |= 1u << r;
      who[r] = c;
    }
    for (int j = 0; j < L; ++j) {
      const unsigned full = (1u << L) - 1;
      const unsigned mask = ((residues << j) | (residues >> (L - j))) & full;
      if (mask != w.write_mask[j])
        return TIDE_STR_CAT(where(rs, w), ": write mask of GPU j=", j, " is ",
                            int(w.write_mask[j]), ", the contributors fill ", mask);
    }
  }
  // 3. Stale-block freedom: before each landing, every block the current wave does not write
  // holds zeros. A call starts from unknown inbox contents (every block possibly dirty). The L
  // per-GPU masks are packed into one word (byte j = GPU j); bitwise ops keep bytes independent.
  uint64_t all_dirty = 0;
  for (int j = 0; j < L; ++j) all_dirty |= uint64_t((1u << L) - 1) << (8 * j);
  for (int call = 0; call < 1; ++call) {
    uint64_t dirty[2] = {all_dirty, all_dirty};
    for (const RsWave& w : rs.wave_list) {
      const uint64_t write = pack_masks(w.write_mask), zero = pack_masks(w.zero_mask);
      if (zero & write) {
        const int j = first_byte(zero & write);
        return TIDE_STR_CAT(where(rs, w), ": zeroes blocks ",
                            int(w.zero_mask[j] & w.write_mask[j]), " of GPU j=", j,
                            " that this wave writes (a race with its puts)");
      }
      uint64_t& d = dirty[w.gen];
      d &= ~zero;
      const uint64_t stale = d & ~write;
      if (stale) {
        const int j = first_byte(stale);
        const unsigned bits = unsigned(stale >> (8 * j)) & 0xffu;
        int s = 0;
        while (!(bits & (1u << s))) ++s;
        return TIDE_STR_CAT(where(rs, w), ": inbox block s=", s,
                            " of destination GPU j=", j, " may still hold a partial from an "
                            "earlier wave or call on generation ", w.gen, " and would be landed "
                            "again (stale-block zeroing missing)");
      }
      d |= write;
    }
  }
  return std::string();
}

std::string check_rs_rounds(const RsSchedule& rs) {
  const int M = rs.M;
  if (rs.k < 1) return TIDE_STR_CAT("Options.k: round width must be >= 1, got ", rs.k);
  if (rs.d_rem != static_cast<int64_t>(rs.n_part) * (M - 1))
    return TIDE_STR_CAT("RS schedule: D_rem=", rs.d_rem, ", expected n_part*(M-1)=",
                        static_cast<int64_t>(rs.n_part) * (M - 1));
  int next = 0, eq9 = 0, prev_k = 0;
  int64_t prev_j0 = 0;
  for (size_t g = 0; g < rs.wave_list.size(); ++g) {
    const RsWave& w = rs.wave_list[g];
    const int remote_end = std::min(w.c_end, M);
    int c = w.c_begin;
    if (w.round_begin != next)
      return TIDE_STR_CAT(where(rs, w), ": its rounds start at ", w.round_begin, ", expected ", next);
    for (int ri = w.round_begin; ri < w.round_end; ++ri) {
      const RsRound& r = rs.rounds[ri];
      const int ki = r.c_end - r.c_begin;
      if (r.wave != static_cast<int>(g) || r.pass != w.pass || r.c_begin != c || ki < 1 ||
          ki > rs.k || r.c_end > remote_end)
        return TIDE_STR_CAT(where(rs, w), ": round ", ri, " (contributors ", r.c_begin, "..",
                            r.c_end - 1, ") must take the next 1..k=", rs.k,
                            " remote contributors of this wave (rounds never cross a wave)");
      c = r.c_end;
      // Outbox reuse: blocks J mod n_out of this round and the previous one are live together.
      const int64_t j0 = static_cast<int64_t>(w.pass) * (M - 1) + r.c_begin - 1;
      if (ri > 0 && j0 - prev_j0 != prev_k)
        return TIDE_STR_CAT("RS schedule: round ", ri, " does not follow round ", ri - 1,
                            " in destination order");
      if (prev_k + ki > rs.n_out)
        return TIDE_STR_CAT(where(rs, w), ": rounds ", ri - 1, " and ", ri, " hold ", prev_k + ki,
                            " outbox blocks but a bank has n_out=", rs.n_out,
                            " (Eq. 9 needs max(k_i + k_(i-1)))");
      eq9 = std::max(eq9, prev_k + ki);
      prev_k = ki;
      prev_j0 = j0;
    }
    if (c != remote_end)
      return TIDE_STR_CAT(where(rs, w), ": remote contributors ", c, "..", remote_end - 1,
                          " are in no round");
    next = w.round_end;
  }
  if (next != static_cast<int>(rs.rounds.size()))
    return TIDE_STR_CAT("RS schedule: ", rs.rounds.size() - next, " rounds belong to no wave");
  const int want = rs.mode == Mode::kSlotReuse ? eq9 : std::max(M - 1, eq9);
  if (rs.n_out != want)
    return TIDE_STR_CAT("RS schedule: n_out=", rs.n_out, " but ", mode_name(rs.mode),
                        " with these rounds needs ", want,
                        rs.mode == Mode::kSlotReuse ? " (Eq. 9)" : " (a full outbox, M-1)");
  return std::string();
}

void validate_rs(const RsSchedule& rs, const Topology& topo, const Options& opt) {
  TIDE_PLAN_CHECK(rs.M == topo.nodes && rs.L == topo.gpus_per_node,
                  "RS schedule built for M=", rs.M, ", L=", rs.L, " used on M=", topo.nodes,
                  ", L=", topo.gpus_per_node);
  if (rs.direct) {  // [Note: direct Level 1]: no waves or rounds to check
    TIDE_PLAN_CHECK(rs.wave_list.empty() && rs.rounds.empty() && rs.n_out == 0 && rs.n_par == 0,
                    "a direct (one-node) RS schedule has Level-2 state");
    return;
  }
  std::string why = check_rs_waves(rs);
  if (why.empty()) why = check_rs_rounds(rs);
  if (!why.empty()) throw PlanError(why);
}

ValidateAllResult validate_all(int L, int max_nodes, int min_nodes) {
  TIDE_PLAN_CHECK(L >= 1 && L <= kMaxGpusPerNode, "--gpus-per-node: must be in [1, ",
                  kMaxGpusPerNode, "], got ", L);
  TIDE_PLAN_CHECK(max_nodes >= 2 && max_nodes <= kMaxNodes, "--max-nodes: must be in [2, ", kMaxNodes,
                  "], got ", max_nodes);
  TIDE_PLAN_CHECK(min_nodes >= 2 && min_nodes <= max_nodes + 1, "validate_all: min_nodes must be in [2, max_nodes+1=",
                  max_nodes + 1, "], got ", min_nodes);  // max_nodes + 1: an empty range, the arguments checked only
  const Mode modes[2] = {Mode::kInPlace, Mode::kSlotReuse};
  ValidateAllResult res;
  // Index np-1 holds n_part = np on the same (M, W_wave); np = 1 is the base plan.
  RsSchedule rs[4];
  std::string waves_why[4];
  // Rounds split each wave's <= W_wave remote contributors into groups of k, so they depend on k
  // only through k_eff = min(k, W_wave): the round structure, Eq. 9 depth and every round check
  // of a k >= W_wave equal those of k = W_wave except the width bound k_i <= k, which is
  // re-checked per k from the widest round.
  std::string rounds_why[4][kMaxGpusPerNode + 1][2];
  int widest[4][kMaxGpusPerNode + 1];
  for (int M = min_nodes; M <= max_nodes; ++M) {
    for (int ww = 1; ww <= L; ++ww) {
      bool pair_ok = true;
      for (int np = 1; np <= 4; ++np) {
        build_rs_waves(rs[np - 1], M, L, ww, np);
        waves_why[np - 1] = check_rs_waves(rs[np - 1]);
        if (np == 1 && !waves_why[0].empty()) break;
        if (!waves_why[np - 1].empty()) continue;
        for (int ke = 1; ke <= std::min(ww, kMaxRoundWidth); ++ke) {
          for (int mi = 0; mi < 2; ++mi) {
            build_rs_rounds(rs[np - 1], ke, modes[mi]);
            rounds_why[np - 1][ke][mi] = check_rs_rounds(rs[np - 1]);
          }
          int wmax = 0;
          for (const RsRound& r : rs[np - 1].rounds) wmax = std::max(wmax, r.c_end - r.c_begin);
          widest[np - 1][ke] = wmax;
        }
      }
      if (!waves_why[0].empty()) {
        res.rejected += 2 * kMaxRoundWidth;
        res.rejected_pairs.emplace_back(M, ww);
        continue;
      }
      auto verdict = [&](int np, int k, int mi) -> std::string {
        if (!waves_why[np - 1].empty()) return waves_why[np - 1];
        const int ke = std::min(k, ww);
        if (widest[np - 1][ke] > k)
          return TIDE_STR_CAT("a round has ", widest[np - 1][ke], " transfers > k=", k);
        return rounds_why[np - 1][ke][mi];
      };
      for (int k = 1; k <= kMaxRoundWidth; ++k) {
        for (int mi = 0; mi < 2; ++mi) {
          if (!verdict(1, k, mi).empty()) {
            ++res.rejected;
            pair_ok = false;
            continue;
          }
          ++res.accepted;
          for (int np = 2; np <= 4; ++np) {
            const std::string why = verdict(np, k, mi);
            ++res.n_part_checked;
            if (!why.empty() && res.n_part_ok) {
              res.n_part_ok = false;
              res.first_n_part_failure = TIDE_STR_CAT("M=", M, ", W_wave=", ww, ", n_part=", np,
                                                      ", k=", k, ", ", mode_name(modes[mi]),
                                                      ": ", why);
            }
          }
        }
      }
      (pair_ok ? res.accepted_pairs : res.rejected_pairs).emplace_back(M, ww);
    }
  }
  return res;
}

}  // namespace tide
