"""TIDE-RS expert lane (L_sub = 1, App. F) and HSDP (shard-group RS, then the replica all-reduce)."""
import ml_dtypes
import numpy as np
import pytest

import tide
from tide import _core

BF16 = np.dtype(ml_dtypes.bfloat16)


def lane_plan(M, shapes=None):
    shapes = shapes or [(5 * M + 3, 8), (7,), (12 * M, 6)]
    return tide.plan(tide.GroupSignature(shapes=shapes), tide.Topology(M, 1)), shapes


def ref_outs(plan, grads):
    lay, N = plan.layout, len(grads)
    outs = [np.zeros(lay.E) for _ in range(N)]
    for p in range(lay.P):
        tot = sum(np.asarray(g[p], np.float64) for g in grads).reshape(-1)
        full = np.zeros(N * lay.params[p].e)
        full[:tot.size] = tot
        e, o = lay.params[p].e, lay.params[p].o32
        for r in range(N):
            outs[r][o:o + e] = full[r * e:(r + 1) * e]
    return outs


@pytest.mark.parametrize("M", [1, 2, 8, 9, 17])
def test_expert_lane_checked_and_exact(M):
    plan, shapes = lane_plan(M)
    sets = [_core.build_rs_programs(plan, bank=b, expert_lane=True) for b in (0, 1)]
    ok, errors = _core.check_calls([[(sets[s % 2], s) for s in (1, 2, 3)]] * M)
    assert ok, errors
    stats = _core.rs_program_stats(sets[0], 0)
    assert stats["l1_descriptors"] == 0 and stats["sums"] == 0           # no Level 1
    assert stats["puts"] == 4 * (M - 1)                                   # four rail parts
    assert stats["lands"] == max(1, -(-(M - 1) // 7))                     # eight-source waves
    rng = np.random.default_rng(M)
    grads = [[rng.integers(-16, 16, size=s).astype(BF16) for s in shapes] for _ in range(M)]
    vc = tide.VirtualCluster(tide.Topology(M, 1))
    outs = vc.reduce_scatter_expert(plan, grads)
    for out, ref in zip(outs, ref_outs(plan, grads)):
        assert np.array_equal(out, ref.astype(np.float32))
    again = vc.reduce_scatter_expert(plan, grads)
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(outs, again))


def test_expert_lane_normal_inputs_and_alpha():
    M = 11
    plan, shapes = lane_plan(M)
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(s).astype(BF16) for s in shapes] for _ in range(M)]
    vc = tide.VirtualCluster(tide.Topology(M, 1), check=False)
    alpha = _core.rs_fold_alpha("avg", M)
    outs = vc.reduce_scatter_expert(plan, grads, scale=alpha)
    for out, ref in zip(outs, ref_outs(plan, grads)):
        ref = ref * float(alpha)
        assert np.max(np.abs(out - ref)) <= 1e-5 * max(1.0, float(np.max(np.abs(ref))))


@pytest.mark.parametrize("kind,tag", [("drop_wait", "ArrivalWait"), ("drop_credit", "InboxCredit"),
                                      ("drop_fence", "GenWait")])
def test_expert_lane_faults_detected(kind, tag):
    M = 17  # three waves: generations reused within a call
    plan, _ = lane_plan(M)
    tags = dict(_core.op_tags, **_core.rs_op_tags)
    sets = [_core.build_rs_programs(plan, bank=b, expert_lane=True) for b in (0, 1)]
    for ps in sets:
        assert ps.inject_fault(_core.fault_kinds[kind], 3, tags[tag])
    ok, errors = _core.check_calls([[(sets[s % 2], s) for s in (1, 2, 3)]] * M)
    assert not ok and errors


def test_expert_lane_needs_one_rank_per_node():
    plan = tide.plan(tide.GroupSignature(shapes=[(64, 4)]), tide.Topology(2, 2))
    with pytest.raises(tide.PlanError, match="L_sub = 1"):
        _core.build_rs_programs(plan, expert_lane=True)


def test_hsdp_shard_group_rs_then_replica_all_reduce():
    M, L, G = 2, 4, 3  # three replica groups, each a 2 x 4 shard group
    shapes = [(5 * M * L + 3, 8), (7,)]
    plan = tide.plan(tide.GroupSignature(shapes=shapes), tide.Topology(M, L))
    rng = np.random.default_rng(5)
    grads = [[[rng.integers(-8, 8, size=s).astype(BF16) for s in shapes] for _ in range(M * L)]
             for _ in range(G)]
    vc = tide.VirtualCluster(tide.Topology(M, L), check=False)
    outs = vc.reduce_scatter_hsdp(plan, grads, scale=0.5)
    # the replica all-reduce leaves every group with the same full-data-parallel sum
    per_group = [ref_outs(plan, grads[g]) for g in range(G)]
    for g in range(G):
        for r in range(M * L):
            want = sum(0.5 * per_group[h][r] for h in range(G))
            assert np.array_equal(outs[g][r], want.astype(np.float32))
