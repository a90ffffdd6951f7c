"""The op vocabulary beyond the AG (SUM, LAND, ZERO, CAST, CREDIT) on the executor and the
checker, through a hand-written two-rank reduce program (the shape TIDE-RS programs take)."""
import ml_dtypes
import numpy as np
import pytest

import tide
from tide import _core
from ag_helpers import make_plan

F = _core.fault_kinds
n = 8      # gradient elements per rank
h = n // 2  # output elements per rank


def reduce_spec(skip_credit=False):
    """Rank r pushes the peer's half of its bf16 gradient into the peer's staging, signals; the
    owner SUMs (peer term, then own) into an arena block (ring1: a one-node plan lays out no inbox), zeroes `out`, LANDs with alpha 0.5."""
    ranks = []
    for r in range(2):
        q = 1 - r
        ops = [
            dict(kind="WAIT", stream=0, counter=(r, 3), value=-1, per_call=1, tag=7),  # staging credit from q
            dict(kind="COPY", stream=0, copies=[(("grad", r, 0, 2 * h * q, 2 * h), ("staging", q, -1, 0, 2 * h))]),
            dict(kind="SIGNAL", stream=0, counter=(q, 0), value=1),
            dict(kind="WAIT", stream=0, counter=(r, 0), value=0, per_call=1),
            dict(kind="SUM", stream=0, dst=("ring1", r, 0, 0, 4 * h),
                 terms=[(("staging", r, -1, 0, 2 * h), "bfloat16", 0, h, 0),
                        (("grad", r, 0, 2 * h * r, 2 * h), "bfloat16", 0, h, 1)]),
            dict(kind="EVENT_RECORD", stream=0, counter=(r, 1), value=0, per_call=1),  # release
            dict(kind="CREDIT", stream=0, counter=(q, 3), value=1),
            dict(kind="ZERO", stream=0, dst=("out", r, -1, 0, 4 * h)),
            dict(kind="LAND", stream=0, dst=("out", r, -1, 0, 4 * h), alpha=0.5, accumulate=True,
                 terms=[(("ring1", r, 0, 0, 4 * h), "float32", 0, h, 0)]),
            dict(kind="EVENT_RECORD", stream=0, counter=(r, 2), value=0, per_call=1),  # done
        ]
        if skip_credit:
            ops = [o for o in ops if o["kind"] != "CREDIT"]
        ranks.append(dict(
            streams=["caller"], num_counters=4, ops=ops, release_event=1, done_event=2,
            user_inputs=[("grad", r, 0, 0, 2 * n)], user_outputs=[("out", r, -1, 0, 4 * h)],
            expects=[(("out", r, -1, 0, 4 * h), "float32",
                      [(("grad", 0, 0, 2 * h * r, 2 * h), "bfloat16"), (("grad", 1, 0, 2 * h * r, 2 * h), "bfloat16")])]))
    return ranks


@pytest.fixture()
def plan():
    return make_plan(1, 2, shapes=[(64, 8)])[1]


def test_reduce_program_checks_and_runs_exactly(plan):
    progs = _core.program_set_from_spec(plan, reduce_spec())
    ok, errors = progs.check(3)
    assert ok, errors
    rng = np.random.default_rng(0)
    g = [rng.integers(-50, 50, n).astype(np.float32).astype(ml_dtypes.bfloat16) for _ in range(2)]
    outs = [np.full(h, np.nan, np.float32) for _ in range(2)]
    arena = _core.CpuArena(2, progs)
    arena.run([[(progs, 1), (progs, 2)] for _ in range(2)],
              [[(_core.buf_kinds["grad"], 0, g[r].view(np.uint8)), (_core.buf_kinds["out"], -1, outs[r].view(np.uint8))]
               for r in range(2)], timeout_s=5)
    for r in range(2):
        want = 0.5 * (g[1 - r][h * r:h * r + h].astype(np.float32) + g[r][h * r:h * r + h].astype(np.float32))
        assert np.array_equal(outs[r], want)


def test_skipped_zero_is_caught(plan):
    progs = _core.program_set_from_spec(plan, reduce_spec())
    assert progs.inject_fault(F["skip_zero"], 1)
    ok, errors = progs.check(2)
    assert not ok and any(e.startswith("I1 landing") and "rank 1" in e for e in errors), errors


def test_missing_credit_deadlocks_and_dropped_release_order_races(plan):
    ok, errors = _core.program_set_from_spec(plan, reduce_spec(skip_credit=True)).check(2)
    assert not ok and any("I4 deadlock" in e for e in errors)
    progs = _core.program_set_from_spec(plan, reduce_spec())
    assert progs.inject_fault(F["drop_wait"], 0, 7)  # the staging credit wait
    ok, errors = progs.check(2)
    assert not ok and any("I3 race" in e and "staging" in e for e in errors), errors


def test_reading_sources_after_release_is_i2(plan):
    spec = reduce_spec()
    for r in range(2):  # move the release before the SUM that still reads the gradient
        ops = spec[r]["ops"]
        rel = ops.pop(5)
        ops.insert(4, rel)
    ok, errors = _core.program_set_from_spec(plan, spec).check(2)
    assert not ok and any(e.startswith("I2") for e in errors), errors


def test_push_rule_is_enforced(plan):
    spec = reduce_spec()
    spec[0]["ops"][1]["copies"] = [(("grad", 1, 0, 0, 2 * h), ("staging", 1, -1, 0, 2 * h))]  # reads rank 1's grad
    ok, errors = _core.program_set_from_spec(plan, spec).check(1)
    assert not ok and any("rule:" in e and "rank-local" in e for e in errors), errors


def mini_ag_spec(plan, duplicate=False):
    """Single node, L=2: each rank pushes its resident shard into both landings (ring0)."""
    S = plan.layout.S
    ranks = []
    for r in range(2):
        copies = [(("resident", r, -1, 0, S), ("ring0", j, -1, r * S, S)) for j in range(2)]
        if duplicate:
            copies.append(copies[0])
        ops = [dict(kind="COPY", stream=0, copies=copies),
               dict(kind="EVENT_RECORD", stream=0, counter=(r, 3), value=0, per_call=1)]
        ops += [dict(kind="SIGNAL", stream=0, counter=(j, r), value=1) for j in range(2)]
        ops += [dict(kind="WAIT", stream=0, counter=(r, j), value=0, per_call=1) for j in range(2)]
        ops += [dict(kind="EVENT_RECORD", stream=0, counter=(r, 2), value=0, per_call=1)]
        ranks.append(dict(streams=["caller"], num_counters=4, ops=ops, release_event=3, done_event=2,
                          user_inputs=[("resident", r, -1, 0, S)], user_outputs=[("ring0", r, -1, 0, 2 * S)],
                          expects=[(("ring0", r, -1, j * S, S), "bfloat16", [(("resident", j, -1, 0, S), "bfloat16")])
                                   for j in range(2)]))
    return ranks


def test_landing_written_twice_in_one_call_is_i1():
    plan = make_plan(1, 2, shapes=[(6, 2)])[1]
    ok, errors = _core.program_set_from_spec(plan, mini_ag_spec(plan)).check(1)
    assert ok, errors
    ok, errors = _core.program_set_from_spec(plan, mini_ag_spec(plan, duplicate=True)).check(1)
    assert not ok and any(e.startswith("I1 exactly-once") for e in errors), errors
    # The second call also needs readiness: without it the next call's pushes race the
    # consumption of the previous landing.
    ok, errors = _core.program_set_from_spec(plan, mini_ag_spec(plan)).check(2)
    assert not ok and any("race" in e and "ring0" in e for e in errors), errors
