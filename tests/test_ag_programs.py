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
