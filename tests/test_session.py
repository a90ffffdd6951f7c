"""The call runtime (tide/session.h) from Python: CounterSpace ranges, a GroupSession's budgets,
sequence numbers and bank rule, and its members rule, on the CPU cluster executor."""
import numpy as np
import pytest

import tide
from tide import _core

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(37, 16), (5,), (64, 3, 8)]
KIND = dict(_core.buf_kinds)


def _plan(M=2, L=2, **kw):
    return tide.plan(tide.GroupSignature(shapes=SHAPES), tide.Topology(M, L), **kw)


def test_counter_space_hands_out_consecutive_ranges():
    a, b = _plan(), _plan(1, 4)
    space = _core.CounterSpace()
    used = 0
    for plan, kind in ((a, "all_gather"), (a, "reduce_scatter"), (b, "reduce_scatter")):
        n = _core.program_counters(plan, kind)
        assert n > 0
        assert space.reserve(plan, kind) == used
        used += n
    assert space.used == used and space.region_bytes == 8 * (used + 1)  # + the entry fence


def _session(plan, **kw):
    ex = _core.CpuClusterExecutor(plan.world, plan, ["reduce_scatter"])
    return _core.GroupSession(plan, ex, ["reduce_scatter"], **kw), ex


def _rs(session, plan, rng, keep):
    rows = []
    for _ in range(plan.world):
        row = []
        for p, s in enumerate(_core.plan_shapes(plan)):
            g = rng.integers(-4, 5, size=int(np.prod(s))).astype(np.float32).astype(BF16)
            keep.append(g)
            row.append((KIND["grad"], p, g.ctypes.data, g.nbytes))
        out = np.full(plan.layout.E, np.nan, np.float32)
        keep.append(out)
        row.append((KIND["out"], -1, out.ctypes.data, out.nbytes))
        rows.append(row)
    return session.reduce_scatter(0.5, False, rows)


def test_budgets_seq_and_banks():
    plan = _plan()
    s, _ = _session(plan)
    assert (s.sum_ctas, s.land_ctas) == (plan.solver["sum_ctas"], plan.solver["land_ctas"])
    o, _ = _session(plan, sum_ctas=7, land_ctas=3)
    assert (o.sum_ctas, o.land_ctas) == (7, 3)
    rng, keep = np.random.default_rng(1), []
    assert [_rs(s, plan, rng, keep) for _ in range(3)] == [1, 2, 3] and s.calls("reduce_scatter") == 3
    # rs_bank(seq) = (seq - 1) mod 2: calls 1 and 3 share a program set, call 2 uses the other bank.
    d = [s.programs("reduce_scatter", q, 0.5).describe(0) for q in (1, 2, 3)]
    assert d[0] == d[2] and d[0] != d[1]
    with pytest.raises(tide.PlanError, match="sum_ctas"):
        _session(plan, sum_ctas=-1)


def test_members_are_the_whole_executor_or_a_sub_group():
    """members = 0..N-1 is the whole executor (the session drops it, so executors see no
    sub-group); a real sub-group on a cluster executor is refused by name."""
    plan = _plan()
    s, _ = _session(plan, members=list(range(plan.world)))
    keep = []
    assert _rs(s, plan, np.random.default_rng(2), keep) == 1
    assert not np.isnan(keep[-1]).any()
    with pytest.raises(tide.PlanError, match="members: 3 ranks for a plan of 4"):
        _session(plan, members=[0, 1, 2])
    big = _core.CpuClusterExecutor(8, _plan(2, 4), ["reduce_scatter"])
    sub = _core.GroupSession(plan, big, ["reduce_scatter"], members=[0, 2, 4, 6])
    with pytest.raises(tide.PlanError, match="no sub-groups"):
        _rs(sub, plan, np.random.default_rng(3), [])
