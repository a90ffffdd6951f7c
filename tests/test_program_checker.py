"""Static checker: every program the AG builder emits is proven I1-I4 over a grid, and the
checker rejects hand-broken programs (it is not vacuous)."""
import pytest

from tide import _core
from ag_helpers import make_plan

SMALL = [(5, 3), (9,)]


@pytest.mark.parametrize("L", [1, 2, 4, 8])
def test_grid_m_1_to_16(L):
    for M in range(1, 17):
        for cast in (False, True):
            _, plan = make_plan(M, L, shapes=SMALL, shard_dtype="float32" if cast else None)
            for resident in ((True, False) if not cast else (False,)):
                progs = _core.build_ag_programs(plan, resident=resident, head_bytes=16)
                ok, errors = progs.check(2)
                assert ok, (M, L, cast, resident, errors)


@pytest.mark.parametrize("L", [1, 2, 4, 8])
def test_grid_m_64(L):
    _, plan = make_plan(64, L, shapes=[(3,)])
    ok, errors = _core.build_ag_programs(plan, head_bytes=16).check(2)
    assert ok, errors


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 16, 64])
def test_expert_lane_programs(M):
    _, plan = make_plan(M, 1, shapes=SMALL)
    ok, errors = _core.build_ag_programs(plan, expert_lane=True).check(3)
    assert ok, errors


def test_three_calls_two_groups_interleaved():
    _, a = make_plan(4, 2, shapes=SMALL)
    _, b = make_plan(4, 2, shapes=[(17, 2)])
    pa = _core.build_ag_programs(a, group=0, ring_slot=0)
    pb = _core.build_ag_programs(b, group=1, ring_slot=1)
    calls = [[(pa, 1), (pb, 1), (pa, 2), (pb, 2), (pa, 3)] for _ in range(8)]
    ok, errors = _core.check_calls(calls)
    assert ok, errors


def test_checker_is_not_vacuous_on_wrong_landing_offsets():
    _, plan = make_plan(3, 2, shapes=SMALL)
    progs = _core.build_ag_programs(plan)
    # A plan for a different shape has different landing offsets: its programs on half the
    # ranks disagree with the plan hash (I4) ...
    _, other = make_plan(3, 2, shapes=[(5, 3), (10,)])
    bad = _core.build_ag_programs(other)
    calls = [[(progs if r % 2 else bad, 1)] for r in range(6)]
    ok, errors = _core.check_calls(calls)
    assert not ok and any("I4 plan" in e for e in errors)


def test_rule_and_deadlock_messages_name_rank_op_and_seq():
    _, plan = make_plan(4, 1, shapes=SMALL)
    progs = _core.build_ag_programs(plan)
    assert progs.inject_fault(_core.fault_kinds["drop_credit"], 2)
    ok, errors = progs.check(2)
    assert not ok
    assert any("I4 deadlock" in e and "rank" in e and "seq 2" in e and "op" in e for e in errors), errors
