"""RS schedule (Section 4): sub-slices, segment table, coalesced Level-1 pushes, rounds, n_out."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tide
from tide import _core


def make(shapes, M, L, **kw):
    grad = kw.pop("grad_dtype", "bfloat16")
    kw.setdefault("n_part", 1)  # one-pass geometry unless a test names its passes
    return tide.plan(tide.GroupSignature(shapes=shapes, grad_dtype=grad), tide.Topology(M, L), **kw)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 7)), min_size=1, max_size=6),
       M=st.integers(1, 5), L=st.sampled_from([1, 2, 4, 8]), n_part=st.integers(1, 3))
def test_segments_partition_the_output(shapes, M, L, n_part):
    p = make(shapes, M, L, n_part=n_part)
    rs, lay = p.rs_schedule, p.layout
    assert rs.E_sub % 4 == 0 and rs.E_sub >= -(-rs.E_stg // L) and rs.E_stg % 4 == 0
    if M == 1:  # [Note: direct Level 1]: one span, the whole output; no blocks
        assert rs.direct and rs.block_bytes == 0 and len(rs.subslices) == 1 and rs.E_span == lay.E
        assert rs.stg_slot_bytes == (L - 1) * rs.E_chunk * rs.b_grad
    else:
        assert rs.block_bytes == 4 * L * rs.E_sub
        assert rs.stg_slot_bytes == (L - 1) * L * rs.E_chunk * rs.b_grad
    covered = np.zeros(lay.E, dtype=np.int32)
    for sub in rs.subslices:
        assert sub.length <= rs.E_span
        col = 0
        for seg in rs.segments[sub.seg_begin:sub.seg_end]:
            pl = lay.params[seg.param]
            assert seg.out_offset == pl.o32 + seg.param_offset
            assert seg.sub_offset == col and seg.out_offset == sub.out_begin + col
            assert 0 <= seg.param_offset and seg.param_offset + seg.length <= pl.e
            covered[seg.out_offset:seg.out_offset + seg.length] += 1
            col += seg.length
        assert col == sub.length
    assert (covered == 1).all()


def apply_pushes(p, rank, grads):
    """Run one rank's Level-1 copies into per-(c, pass, s, chunk, owner) staging areas."""
    b = p.rs_schedule.b_grad
    L, Ec = p.rs_schedule.L, p.rs_schedule.E_chunk
    areas = {}
    for cp in _core.rs_level1_copies(p, rank):
        key = (cp["c"], cp["pass"], cp["s"], cp["chunk"], cp["owner"])
        area = areas.setdefault(key, np.full(L * Ec, np.nan))
        src = grads[cp["param"]].reshape(-1)
        for h in range(cp["height"]):
            s0 = (cp["src_offset"] + h * cp["src_pitch"]) // b
            d0 = (cp["dst_offset"] + h * cp["dst_pitch"]) // b
            w = cp["width"] // b
            assert np.isnan(area[d0:d0 + w]).all(), "two pushes write the same staging element"
            area[d0:d0 + w] = src[s0:s0 + w]
    return areas


@pytest.mark.parametrize("shapes,M,L,n_part,chunk", [
    ([(37, 3), (5,), (64, 2)], 3, 4, 1, 0),    # padding on the last ranks, params cross sub-slices
    ([(37, 3), (5,), (64, 2)], 3, 4, 2, 0),
    ([(100, 5), (9, 9)], 2, 8, 1, 16),         # chunked staging
    ([(24, 4)], 2, 4, 1, 0),
])
def test_level1_pushes_stage_exactly_the_owner_inputs(shapes, M, L, n_part, chunk):
    """Every staged element equals the pusher's gradient row of the destination rank, rows past
    D_p are never copied, and nothing else is written."""
    p = make(shapes, M, L, n_part=n_part, chunk_bytes=chunk)
    rs, lay = p.rs_schedule, p.layout
    N = M * L
    rng = np.random.default_rng(0)
    for rank in range(N):
        n, i = divmod(rank, L)
        grads = [rng.standard_normal(tuple(s)) for s in shapes]
        areas = apply_pushes(p, rank, grads)
        for c in range(1, M + 1):
            t = (n + c) % M
            for ps in range(rs.n_part):
                for j in range(L):
                    if j == i:
                        continue
                    s = (j + c % M) % L
                    sub = rs.subslices[ps * L + s]
                    for ch in range(rs.n_chunks):
                        area = areas.get((c, ps, s, ch, j))
                        want = np.full(L * rs.E_chunk, np.nan)
                        for seg in rs.segments[sub.seg_begin:sub.seg_end]:
                            pl = lay.params[seg.param]
                            flat = grads[seg.param].reshape(-1)
                            for col in range(seg.sub_offset, seg.sub_offset + seg.length):
                                if not ch * rs.E_chunk <= col < (ch + 1) * rs.E_chunk:
                                    continue
                                for l in range(L):
                                    r = t * L + l
                                    e = r * pl.e + seg.param_offset + col - seg.sub_offset
                                    if e < lay.valid_rows(seg.param, r) * pl.K + r * pl.e:
                                        want[l * rs.E_chunk + col - ch * rs.E_chunk] = flat[e]
                        if area is None:
                            assert np.isnan(want).all()
                        else:
                            np.testing.assert_array_equal(area, want)


def test_descriptor_counts_coalesce_the_rank_axis():
    M, L = 4, 8
    # P = 1, no padding, E = 240 in 8 sub-slices of E_sub = 32 (the last one 16 live): every owner
    # has a live sub-slice, so one strided push per (owner, node).
    p = make([(M * L * 6, 40)], M, L)
    assert p.rs_schedule.l1_descriptors_per_rank == (L - 1) * 1 * M == p.rs_schedule.l1_coalesced_formula
    assert p.rs_schedule.l1_tail_descriptors_per_rank == 0
    assert p.rs_schedule.l1_flat_descriptors_per_rank == (L - 1) * M * L
    for rank in (0, 13, 31):
        cps = _core.rs_level1_copies(p, rank)
        assert len(cps) == (L - 1) * M and all(c["height"] == L for c in cps)
    # The paper's (8, 64, 30): 107,520 flat copies become 13,440 strided ones.
    big = make([(64 * 8 * 2, 4)] * 30, 64, 8)
    assert big.rs_schedule.l1_flat_descriptors_per_rank == 107_520
    assert big.rs_schedule.l1_coalesced_formula == 13_440
    # Padded final rows add short tails.
    q = make([(M * L * 6 - 3, 40)], M, L)  # sub-slices cross rows: padded rows need tails
    assert q.rs_schedule.l1_tail_descriptors_per_rank > 0
    assert q.rs_schedule.l1_descriptors_per_rank == max(len(_core.rs_level1_copies(q, r)) for r in range(L))


def test_outbox_depth_eq9():
    g = [(4096, 64)]
    assert make(g, 64, 8, mode="in_place", k=4).rs_schedule.n_out == 63
    sr = make(g, 64, 8, mode="slot_reuse", k=4).rs_schedule
    assert sr.n_out == 8  # 2k
    ks = [r.c_end - r.c_begin for r in sr.rounds]
    assert sr.n_out == max(a + b for a, b in zip(ks, [0] + ks[:-1]))
    assert [c for r in sr.rounds for c in range(r.c_begin, r.c_end)] == list(range(1, 64))
    assert make(g, 2, 8, mode="slot_reuse", k=4).rs_schedule.n_out == 1
    # M = 9, k = 4: waves {1..8} {9 own}: rounds 4, 4 -> 8
    assert make(g, 9, 8, mode="slot_reuse", k=4).rs_schedule.n_out == 8
    assert make(g, 9, 8, mode="in_place", k=4).rs_schedule.n_out == 8
    # rounds never cross a wave
    r = make(g, 12, 8, mode="slot_reuse", k=3, w_wave=4).rs_schedule
    for rd in r.rounds:
        wv = r.waves_info[rd.wave]
        assert wv["c_begin"] <= rd.c_begin < rd.c_end <= min(wv["c_end"], 12)
        assert rd.c_end - rd.c_begin <= 3


def test_sizes_and_passes():
    p = make([(1000, 3), (17,)], 3, 4, w_wave=4)
    rs = p.rs_schedule
    assert p.layout.E == 84 * 3 + 2  # R = ceil(1000/12) = 84 rows of 3, plus ceil(17/12) = 2
    assert rs.E_stg == 256 and rs.E_sub == 64 and rs.n_par == 1 and rs.waves == 1
    assert rs.n_spare == 1 and rs.d_rem == 2
    p2 = make([(1000, 3), (17,)], 3, 4, n_part=2)
    assert p2.rs_schedule.E_stg == 128 and p2.rs_schedule.E_sub == 32 and p2.rs_schedule.n_spare == 1
    tiny = make([(4,)], 2, 2, n_part=4).rs_schedule  # passes 1..3 hold no live elements
    assert [s.length for s in tiny.subslices] == [1, 0] + [0] * 6
    assert make([(64, 8)], 2, 4, grad_dtype="float32").rs_schedule.b_grad == 4


@pytest.mark.parametrize("shapes,L,chunk", [([(37, 3), (5,), (64, 2)], 4, 0), ([(100, 5), (9, 9)], 8, 16)])
def test_direct_pushes_stage_exactly_the_owner_rows(shapes, L, chunk):
    """One node ([Note: direct Level 1]): rank i pushes owner j exactly j's valid rows of every
    parameter, chunk by chunk, one 1-D piece per segment, and nothing to itself."""
    p = make(shapes, 1, L, chunk_bytes=chunk)
    rs, lay = p.rs_schedule, p.layout
    assert rs.direct and rs.E_span == lay.E and rs.n_chunks == -(-lay.E // rs.E_chunk)
    rng = np.random.default_rng(1)
    for i in range(L):
        grads = [rng.standard_normal(tuple(s)) for s in shapes]
        got = {}
        for cp in _core.rs_level1_copies(p, i):
            assert cp["height"] == 1 and cp["owner"] != i
            row = got.setdefault(cp["owner"], np.full(lay.E, np.nan))
            src = grads[cp["param"]].reshape(-1)
            s0, d0, w = cp["src_offset"] // 2, cp["dst_offset"] // 2 + cp["chunk"] * rs.E_chunk, cp["width"] // 2
            assert np.isnan(row[d0:d0 + w]).all()
            row[d0:d0 + w] = src[s0:s0 + w]
        assert sorted(got) == [j for j in range(L) if j != i]
        for j, row in got.items():
            want = np.full(lay.E, np.nan)
            for q, pl in enumerate(lay.params):
                v = lay.valid_rows(q, j) * pl.K
                want[pl.o32:pl.o32 + v] = grads[q].reshape(-1)[j * pl.e:j * pl.e + v]
            np.testing.assert_array_equal(row, want)


@pytest.mark.parametrize("M,L", [(1, 8), (2, 4)])
def test_level1_push_steps_form_permutations(M, L):
    """Local rank i pushes to owners i+1, i+2, ... (mod L) in its Level-1 listing (the builder
    walks the same rs_push_owner order): at each push step every owner receives from one peer."""
    p = make([(512, 64), (96,)], M, L)  # every sub-slice holds live elements
    orders = []
    for i in range(L):
        owners = []
        for cp in _core.rs_level1_copies(p, i):
            if cp["c"] == (M if M == 1 else 1) and cp["pass"] == 0 and (not owners or owners[-1] != cp["owner"]):
                owners.append(cp["owner"])
        assert owners == [(i + k) % L for k in range(1, L)], (i, owners)
        orders.append(owners)
    for step in range(L - 1):
        assert sorted(o[step] for o in orders) == list(range(L))
