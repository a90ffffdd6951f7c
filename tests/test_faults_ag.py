"""Fault injection on TIDE-AG: every fault is caught (the checker rejects the program, or the
executor reports corruption / times out naming rank, op and seq). Never a silent wrong result,
never a hang."""
import re

import numpy as np
import pytest

import tide
from tide import _core
from ag_helpers import SHAPES, make_fulls, make_plan, reference, same_bits, shard

F = _core.fault_kinds
T = _core.op_tags
M, L = 4, 2
N = M * L


@pytest.fixture()
def setup():
    topo, plan = make_plan(M, L)
    vc = tide.VirtualCluster(topo, timeout_s=1.0)
    fulls = make_fulls(SHAPES, "int", 1)
    vc.all_gather(plan, shard(fulls, plan, N))  # seq 1: arena, resident shards, counters
    return vc, plan, _core.build_ag_programs(plan)


def faulty(progs, kind, rank, tag=0):
    ps = progs.copy()
    assert ps.inject_fault(F[kind], rank, tag), f"{kind} not applicable"
    return ps


def run_two(vc, plan, per_rank_sets):
    """Run calls seq 2 and 3 with the given per-rank program sets (no pre-check)."""
    calls = [[(per_rank_sets[r], 2), (per_rank_sets[r], 3)] for r in range(N)]
    vc.run(plan, calls, [[] for _ in range(N)])


def assert_names_rank_op_seq(msg):
    assert re.search(r"rank \d+", msg) and re.search(r"op \d+ [A-Z_]+", msg) and re.search(r"seq \d+", msg), msg


def test_dropped_credit(setup):
    vc, plan, progs = setup
    bad = faulty(progs, "drop_credit", 3)
    ok, errors = bad.check(2)
    assert not ok and any("I4 deadlock" in e for e in errors)
    with pytest.raises(tide.TimeoutError) as ei:
        run_two(vc, plan, [bad] * N)
    assert_names_rank_op_seq(str(ei.value))
    assert "CREDIT" in str(ei.value) and "seq 3" in str(ei.value)


@pytest.mark.parametrize("tag", ["CreditWait", "ReadyGate"])
def test_dropped_wait(setup, tag):
    _, _, progs = setup
    ok, errors = faulty(progs, "drop_wait", 5, T[tag]).check(2)
    assert not ok and any(e.startswith("I3 race") for e in errors), errors
    assert_names_rank_op_seq(errors[0])


def test_dropped_completion_fence(setup):
    vc, plan, progs = setup
    bad = faulty(progs, "drop_fence", 2)
    ok, errors = bad.check(2)
    assert not ok and any("race" in e and "EVENT_RECORD" in e for e in errors), errors
    # The virtual cluster's sessions check programs before they run them (check=True): the
    # routine they run rejects the faulty set, passes the clean one, and a checked cluster runs.
    vc2 = tide.VirtualCluster(vc.topo, check=True)
    assert vc2._checking()
    _core.testing.check_session_programs("all_gather", [progs])  # a clean set passes
    with pytest.raises(_core.Error, match="checker rejected"):
        _core.testing.check_session_programs("all_gather", [bad])


def test_reordered_calls_on_one_rank(setup):
    vc, plan, progs = setup
    calls = [[(progs, 2), (progs, 3)] for _ in range(N)]
    calls[6] = calls[6][::-1]
    ok, errors = _core.check_calls(calls)
    assert not ok and any("I4 order: rank 6" in e for e in errors)
    with pytest.raises(_core.Error, match="collective order mismatch: rank 6"):
        vc.run(plan, calls, [[] for _ in range(N)])
    # Without the host agreement check the ranks deadlock, and the deadline names the wait.
    vc.faults = dict(verify_agreement=False)
    with pytest.raises(tide.TimeoutError) as ei:
        vc.run(plan, calls, [[] for _ in range(N)])
    assert_names_rank_op_seq(str(ei.value))


@pytest.mark.parametrize("tag", [0, T["RoundHead"]])
def test_stage_block_reused_early(setup, tag):
    _, _, progs = setup
    ok, errors = faulty(progs, "early_reuse", 1, tag).check(2)
    assert not ok and any(e.startswith("I3 race") and "stage" in e for e in errors), errors


def test_stale_zeroing_not_applicable_to_ag(setup):
    _, _, progs = setup
    assert not progs.copy().inject_fault(F["skip_zero"], 0)  # AG programs have no ZERO ops


def test_different_plan_on_one_rank(setup):
    vc, plan, progs = setup
    _, other = make_plan(M, L, shapes=[(7, 3), (5,), (21, 2)])
    odd = _core.build_ag_programs(other)
    calls = [[(odd if r == 4 else progs, 2)] for r in range(N)]
    ok, errors = _core.check_calls(calls)
    assert not ok and any("I4 plan: rank 4" in e for e in errors)
    with pytest.raises(_core.Error, match="plan mismatch: rank 4"):
        vc.run(plan, calls, [[] for _ in range(N)])
    # [Note] Unlike a reordering, a plan disagreement need not stall anything, so it is caught
    # before data moves: ranks compare plan hashes (the executor's agreement check above).


@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
def test_stalled_peer(ranks_as):
    topo, plan = make_plan(M, L)
    fulls = make_fulls(SHAPES, "int", 2)
    vc = tide.VirtualCluster(topo, ranks_as=ranks_as, timeout_s=2.0)
    vc.faults = dict(stall_rank=5, stall_op=3, stall_s=0.2)  # shorter than the deadline: still exact
    out = vc.all_gather(plan, shard(fulls, plan, N))
    assert all(same_bits(out[r][p], reference(fulls)[p]) for r in range(N) for p in range(3))
    vc.timeout_s = 0.3
    vc.faults = dict(stall_rank=5, stall_op=3, stall_s=1.5)  # longer: fail-stop, named
    with pytest.raises(tide.TimeoutError) as ei:
        vc.all_gather(plan, shard(fulls, plan, N))
    assert_names_rank_op_seq(str(ei.value))
    assert "seq 2" in str(ei.value)


@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
def test_dead_peer(ranks_as):
    topo, plan = make_plan(M, L)
    vc = tide.VirtualCluster(topo, ranks_as=ranks_as, timeout_s=0.3)
    vc.faults = dict(dead_rank=2, dead_op=0)
    with pytest.raises(tide.TimeoutError) as ei:
        vc.all_gather(plan, shard(make_fulls(SHAPES, "int", 3), plan, N))
    msg = str(ei.value)
    assert_names_rank_op_seq(msg)
    assert "producer: rank" in msg, msg


def test_random_faults_are_always_rejected():
    """Randomized: every safety-relevant mutation of a random AG program set is rejected."""
    rng = np.random.default_rng(7)
    cases = [("drop_credit", 0), ("drop_wait", T["CreditWait"]), ("drop_wait", T["ReadyGate"]),
             ("drop_fence", 0), ("early_reuse", 0)]
    for _ in range(20):
        M, L = int(rng.integers(3, 9)), int(rng.choice([2, 4]))
        P = int(rng.integers(1, 4))
        shapes = [(int(rng.integers(1, 4 * M * L)), 2) for _ in range(P)]
        _, plan = make_plan(M, L, shapes=shapes)
        kind, tag = cases[int(rng.integers(len(cases)))]
        rank = int(rng.integers(M * L))
        ps = _core.build_ag_programs(plan, resident=bool(rng.integers(2)))
        assert ps.inject_fault(F[kind], rank, tag), (kind, M, L)
        ok, errors = ps.check(2)
        assert not ok, (kind, tag, M, L, rank, shapes)
