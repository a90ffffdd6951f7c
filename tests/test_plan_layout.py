"""Layout (Section 2.1, Eqs. 2-3): landing offsets, RS row ranges, packed sizes."""
from math import prod

from hypothesis import given, settings, strategies as st

import tide

ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}

shapes_st = st.lists(
    st.tuples(st.integers(1, 300)).flatmap(
        lambda d0: st.lists(st.integers(1, 6), max_size=2).map(lambda rest: (*d0, *rest))),
    min_size=1, max_size=6)
topo_st = st.tuples(st.integers(1, 9), st.integers(1, 8))


def _plan(shapes, M, L, ag="bfloat16", **kw):
    return tide.plan(tide.GroupSignature(shapes=shapes, ag_dtype=ag), tide.Topology(M, L), **kw)


@settings(max_examples=80, deadline=None)
@given(shapes_st, topo_st, st.sampled_from(["bfloat16", "float32", "uint8"]))
def test_landing_covers_every_byte_once(shapes, topo, ag):
    M, L = topo
    N = M * L
    g = _plan(shapes, M, L, ag).layout
    b = ITEM[ag]
    # Independent sizes: R_p = ceil(D_p / N), s_p = R_p * K_p * b_ag.
    s = [-(-sh[0] // N) * prod(sh[1:]) * b for sh in shapes]
    assert g.S == sum(s)
    assert g.NS == N * sum(s)
    intervals = sorted((g.landing(p, r), s[p]) for p in range(len(shapes)) for r in range(N))
    pos = 0
    for start, size in intervals:  # sorted, abutting, no gap, no overlap
        assert start == pos
        pos += size
    assert pos == g.NS
    # Parameter-major: every shard of p lands inside p's own [o_p N, (o_p + s_p) N) window.
    o = 0
    for p in range(len(shapes)):
        assert g.params[p].o == o
        for r in range(N):
            assert o * N <= g.landing(p, r) < (o + s[p]) * N
        o += s[p]


@settings(max_examples=80, deadline=None)
@given(shapes_st, topo_st)
def test_rs_rows_partition_and_valid_rows(shapes, topo):
    M, L = topo
    N = M * L
    g = _plan(shapes, M, L).layout
    for p, sh in enumerate(shapes):
        R = g.params[p].R
        nxt = 0
        for r in range(N):
            start, stop = g.rows(p, r)
            assert (start, stop) == (nxt, nxt + R)
            nxt = stop
        assert nxt == N * R and N * R >= sh[0] > N * R - N
        valid = [g.valid_rows(p, r) for r in range(N)]
        assert sum(valid) == sh[0]
        # Valid rows are a prefix: full ranks, at most one partial one, then zero padding.
        assert valid == sorted(valid, reverse=True)
        assert sum(1 for v in valid if 0 < v < R) <= 1


@settings(max_examples=60, deadline=None)
@given(shapes_st, topo_st, st.sampled_from(["bfloat16", "float32"]))
def test_packed_sizes(shapes, topo, grad):
    M, L = topo
    N = M * L
    p = tide.plan(tide.GroupSignature(shapes=shapes, grad_dtype=grad), tide.Topology(M, L))
    g = p.layout
    rk = sum(-(-sh[0] // N) * prod(sh[1:]) for sh in shapes)  # sum_p R_p K_p
    assert g.E == rk
    assert g.S_fp32 == 4 * rk
    assert g.S_grad == ITEM[grad] * rk
    assert g.B_pack == 4 * N * rk  # Eq. 3
    assert [pl.K for pl in g.params] == [prod(sh[1:]) for sh in shapes]


def test_landing_example_by_hand():
    # Two params on 2 x 2 ranks, bf16: (5, 3) -> R=2, s=12; (4,) -> R=1, s=2; S = 14.
    g = _plan([(5, 3), (4,)], 2, 2).layout
    assert (g.params[0].R, g.params[0].s, g.params[1].R, g.params[1].s) == (2, 12, 1, 2)
    assert [g.landing(0, r) for r in range(4)] == [0, 12, 24, 36]
    assert [g.landing(1, r) for r in range(4)] == [48, 50, 52, 54]
    assert [g.valid_rows(0, r) for r in range(4)] == [2, 2, 1, 0]
    assert g.NS == 56 and g.B_pack == 4 * 4 * (6 + 1)


@settings(max_examples=60, deadline=None)
@given(shapes_st, topo_st, st.sampled_from(["bfloat16", "float32", "uint8"]))
def test_layout_is_the_plans(shapes, topo, ag):
    """tide.layout(shapes, N), what the faces ask for R_p / e_p / o32_p, is the planner's layout
    of the same group on any topology of N ranks."""
    M, L = topo
    want = _plan(shapes, M, L, ag).layout
    got = tide.layout(shapes, M * L, ag_dtype=ag)
    assert (got.P, got.N, got.S, got.E, got.S_fp32, got.B_pack) == (want.P, want.N, want.S, want.E, want.S_fp32,
                                                                     want.B_pack)
    for a, b in zip(got.params, want.params):
        assert (a.D, a.K, a.R, a.e, a.s, a.o, a.o32) == (b.D, b.K, b.R, b.e, b.s, b.o, b.o32)


def test_layout_errors_name_the_field():
    import pytest
    with pytest.raises(tide.PlanError, match=r"world: must be >= 1"):
        tide.layout([(4, 2)], 0)
    with pytest.raises(tide.PlanError, match=r"parameter 1: shape\[0\] = 0 must be > 0"):
        tide.layout([(4, 2), (0, 3)], 4)
    with pytest.raises(tide.PlanError, match=r"GroupSignature.shapes\[0\]"):
        tide.layout(["ab"], 4)
    with pytest.raises(tide.PlanError, match=r"the group is empty"):
        tide.layout([], 4)
