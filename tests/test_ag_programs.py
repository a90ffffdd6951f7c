"""Structure of TIDE-AG programs: lead-based pacing, per-area credits, decoupled streams."""
import re

import pytest

from tide import _core
from ag_helpers import make_plan

LINE = re.compile(r"^(\d+) (\w+) \[(\w+)\] tag=(\w+|-)(?: round=(\d+))?(?: counter=(\S+)@(\d+) value=(-?\d+) per_call=(\d+))?")


def parse(progs, r):
    ops = []
    for d in progs.describe(r):
        m = LINE.match(d)
        assert m, d
        i, kind, stream, tag, rnd, cname, crank, value, per_call = m.groups()
        ops.append(dict(i=int(i), kind=kind, stream=stream, tag=tag, round=None if rnd is None else int(rnd),
                        counter=cname, crank=None if crank is None else int(crank),
                        value=None if value is None else int(value)))
    return ops


@pytest.mark.parametrize("M,L", [(5, 2), (8, 1), (13, 4)])
def test_lead_based_pacing_and_credits(M, L):
    _, plan = make_plan(M, L, shapes=[(3 * M * L, 2)])
    progs = _core.build_ag_programs(plan, head_bytes=16)
    R, c = _core.ag_rounds_for(M)
    parsed = [parse(progs, r) for r in range(M * L)]
    for r in range(M * L):
        n, l = divmod(r, L)
        ops = parsed[r]
        caller = [o for o in ops if o["stream"] == "caller"]
        for d in range(R):
            head = next(o for o in caller if o["tag"] == "RoundHead" and o["round"] == d)
            target = ((n - 2 ** d) % M) * L + l
            assert head["crank"] == target and head["counter"] == f"HEAD[{d}]"
            before = caller[: caller.index(head)]
            # Per-area credit: the target released area d of the previous call (seq - 1).
            cw = [o for o in before if o["tag"] == "CreditWait" and o["round"] == d]
            assert cw and cw[-1]["counter"] == f"CREDIT[{d}]" and cw[-1]["value"] == -1
            if d >= 1:  # lead-based pacing: the target confirmed round d-1
                pw = [o for o in before if o["tag"] == "PaceWait" and o["round"] == d]
                assert pw and pw[-1]["counter"] == f"PACE[{d}]"
                # ... and the confirming signal on the target follows its round-(d-1) HEAD wait.
                t_caller = [o for o in parsed[target] if o["stream"] == "caller"]
                sig = next(o for o in t_caller if o["tag"] == "PaceSignal" and o["round"] == d)
                assert sig["crank"] == r
                hw = [o for o in t_caller[: t_caller.index(sig)] if o["tag"] == "ArrivalWait" and o["counter"] == f"HEAD[{d - 1}]"]
                assert hw
        # Credits are emitted by the scatter stream, once per area, to each round's sender.
        credits = [o for o in ops if o["kind"] == "CREDIT"]
        assert sorted((o["round"], o["crank"]) for o in credits) == sorted(
            (d, ((n + 2 ** d) % M) * L + l) for d in range(R))
        assert all(o["stream"] == "scatter" for o in credits)


def test_decoupled_streams():
    _, plan = make_plan(4, 2)
    ops = parse(_core.build_ag_programs(plan), 3)
    by = lambda s: [o for o in ops if o["stream"] == s]  # noqa: E731
    # readiness: waits for the previous consumption only, then publishes readiness.
    assert [o["kind"] for o in by("readiness")] == ["EVENT_WAIT"] + ["SIGNAL"] * 2
    assert by("readiness")[0]["value"] == -1
    # completion: joins the pushes and scatters, node-wide fence, records the consumable event.
    comp = by("completion")
    assert [o["kind"] for o in comp] == ["EVENT_WAIT"] * 2 + ["SIGNAL"] * 2 + ["WAIT"] * 2 + ["EVENT_RECORD"]
    # the caller never waits on the completion fence (the next call is not serialized on it).
    assert not any(o["tag"] in ("DoneWait", "Complete") for o in by("caller"))
    assert not any(o["kind"] == "WAIT" and (o["counter"] or "").startswith("DONE") for o in by("scatter"))


# ---- the pull landing ([Note: pull landing] in tide/program.h) --------------------------------
PULL_SHAPES = [(37, 8), (16,), (5, 3), (3,)]  # (3,) at N = 8: ranks 3..7 hold only padding rows
DESC = re.compile(r"\{(\w+)@(\d+)\+(\d+) -> (\w+)@(\d+)\+(\d+) (\d+)x(\d+)\}")


def copies(progs, r):
    """(src kind, src rank, dst kind, dst rank, bytes) of every COPY/CAST descriptor of rank r."""
    out = []
    for line in progs.describe(r):
        for sk, sr, _so, dk, dr, _do, w, h in DESC.findall(line):
            out.append((sk, int(sr), dk, int(dr), int(w) * int(h)))
    return out


@pytest.mark.parametrize("L", [1, 2, 4, 8])
def test_pull_landing_lands_in_own_user_buffers_and_checks(L):
    """One node, fp32 shards cast to bf16: every rank writes only its own landing user buffers,
    reads its peers' stage, and moves the push design's bytes without the face's copy-out; the
    checker proves the set (expects: every landing byte is its source's cast)."""
    _, plan = make_plan(1, L, shapes=PULL_SHAPES, shard_dtype="float32")
    pull = _core.build_ag_programs(plan, resident=False, pull_landing=True)
    push = _core.build_ag_programs(plan, resident=False)
    ok, errors = pull.check(3)
    assert ok, errors
    lay = plan.layout
    for r in range(L):
        c = copies(pull, r)
        assert {d[2] for d in c} <= {"stage", "landing"} and all(d[3] == r for d in c)  # own buffers only
        assert {d[1] for d in c if d[0] == "stage"} == set(range(L))  # pulls from every local rank
        landed = sum(b for sk, _, dk, _, b in c if dk == "landing")
        assert landed == sum(p.D * p.K * 2 for p in lay.params)  # unpadded rows, each once
        pushed = sum(b for _, _, dk, _, b in copies(push, r) if dk == "ring0")
        assert pushed == L * lay.S  # the push design writes padded shards into every landing
        assert landed <= pushed


def test_pull_landing_faults_are_caught():
    """A dropped stage gate (the next cast overwrites a stage a peer still pulls), a dropped
    readiness wait (a pull before the peer staged) and a dropped credit are each caught."""
    F, T = _core.fault_kinds, _core.op_tags
    _, plan = make_plan(1, 4, shapes=PULL_SHAPES, shard_dtype="float32")
    pull = _core.build_ag_programs(plan, resident=False, pull_landing=True)
    for kind, tag, want in (("drop_wait", 0, "I3 race"), ("drop_wait", T["ReadyGate"], "I3 race"),
                            ("drop_credit", 0, "I4 deadlock")):
        bad = pull.copy()
        assert bad.inject_fault(F[kind], 1, tag), kind
        ok, errors = bad.check(3)
        assert not ok and any(e.startswith(want) for e in errors), (kind, errors)


def test_pull_landing_refuses_what_it_cannot_pull():
    _, bf16_nodes = make_plan(2, 2, shapes=PULL_SHAPES)
    with pytest.raises(_core.PlanError, match="pull_landing: across nodes .* needs a cast"):
        _core.build_ag_programs(bf16_nodes, resident=True, pull_landing=True)
    _, two_nodes = make_plan(2, 2, shapes=PULL_SHAPES, shard_dtype="float32")
    for kw in (dict(multicast=True), dict(expert_lane=True)):
        with pytest.raises(_core.PlanError, match="pull_landing: not with the expert lane or multicast"):
            _core.build_ag_programs(two_nodes, resident=False, pull_landing=True, **kw)
    _, bf16 = make_plan(1, 4, shapes=PULL_SHAPES)
    with pytest.raises(_core.PlanError, match="peers pull from a stage"):
        _core.build_ag_programs(bf16, resident=False, pull_landing=True)
    ok, errors = _core.build_ag_programs(bf16, resident=True, pull_landing=True).check(2)  # resident shards
    assert ok, errors


# ---- the pull landing across nodes ([Note: pull landing across nodes], ag_program.cc) ----------
@pytest.mark.parametrize("M,L", [(2, 2), (4, 2), (2, 1), (3, 2), (5, 2), (3, 4)])
def test_pull_landing_across_nodes_checks_and_keeps_the_rounds(M, L):
    """M > 1 with a cast: the checker proves the set, one-sided and lowered to two-sided rails
    (cross-node PUTs become SEND/RECV); the rail ops are the push program's, no rank writes another
    rank's landing, and each rank lands the unpadded rows once."""
    _, plan = make_plan(M, L, shapes=PULL_SHAPES, shard_dtype="float32")
    for hb in (0, 16):
        pull = _core.build_ag_programs(plan, resident=False, pull_landing=True, head_bytes=hb)
        push = _core.build_ag_programs(plan, resident=False, head_bytes=hb)
        for ps in (pull, pull.lowered()):
            ok, errors = ps.check(3)
            assert ok, (hb, ps.rails, errors)
        lowered = pull.lowered()
        # The counters the sessions reserve (program_counters: the push program's) fit the pull set.
        assert (pull.num_counters, lowered.num_counters) == (push.num_counters, push.lowered().num_counters)
        for r in range(M * L):
            rail = lambda ps: [d.split(" ", 1)[1] for d in ps.describe(r)  # noqa: E731  (no op index)
                               if d.split()[1] in ("PUT", "SEND", "RECV")]
            assert rail(pull) == rail(push) and rail(lowered) == rail(push.lowered())
            assert not any(d.split()[1] == "PUT" for d in lowered.describe(r))
            assert lowered.rail_stats(r) == push.lowered().rail_stats(r)
            c = copies(pull, r)
            assert all(dr == r for _, _, dk, dr, _ in c if dk == "landing")  # own landing only
            assert not any(dk in ("ring0", "ring1") for _, _, dk, _, _ in c)
            assert {sr for sk, sr, dk, _, _ in c if dk == "landing"} == {(r // L) * L + j for j in range(L)}
            landed = sum(b for _, _, dk, _, b in c if dk == "landing")
            assert landed == sum(p.D * p.K * 2 for p in plan.layout.params)


def test_pull_landing_across_nodes_faults_are_caught():
    """Every gate and credit of the rounds' pulls matters: a dropped per-round gate (a pull of a
    peer's area before it arrived), a dropped per-area credit wait (the next call's round overwrites
    an area a local rank still pulls), a dropped cast gate, a dropped forwarding or staging fence
    are each an I3 race; a dropped per-area PULLED signal or CREDIT is an I4 deadlock."""
    F, T = _core.fault_kinds, _core.op_tags
    _, plan = make_plan(4, 2, shapes=PULL_SHAPES, shard_dtype="float32")
    pull = _core.build_ag_programs(plan, resident=False, pull_landing=True)
    for ps in (pull, pull.lowered()):
        for kind, tag, rnd, want in (("drop_wait", "ReadyGate", 0, "I3 race"), ("drop_wait", "ReadyGate", 1, "I3 race"),
                                     ("drop_wait", "CreditWait", 0, "I3 race"), ("drop_wait", "CreditWait", 1, "I3 race"),
                                     ("drop_wait", "CastGate", -1, "I3 race"), ("drop_fence", "Fence", None, "I3 race"),
                                     ("drop_fence", "ReadyWait", None, "I3 race"),
                                     ("drop_credit", "CreditSignal", -1, "I4 deadlock"),
                                     ("drop_credit", "CreditSignal", 1, "I4 deadlock")):
            bad = ps.copy()
            assert bad.inject_fault(F[kind], 1, T[tag], rnd), (kind, tag, rnd)
            ok, errors = bad.check(3)
            assert not ok and any(e.startswith(want) for e in errors), (ps.rails, kind, tag, rnd, errors)
