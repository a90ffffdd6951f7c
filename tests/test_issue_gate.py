"""The same-process issue gate on the host (no GPU): fabric/fabric.h [Note: same-process issue
gate], fabric/issue_board.cc. Threads standing for the rank executors of one process's ranks (each
with its own counter mirror and recorded walk, as CudaRankExecutor has) run calls through the
issue path's steps: every rank's entry, then their fence waits, then the walk of [Note: enqueue
order]; a step is logged when it is enqueued (waits and counter writes wait in a pending batch, as
in issue.cc). With the gate the process's log is exactly the one global order restricted to its
ranks, however the threads are delayed; without it a late thread's steps come after the others'."""
import pytest

import tide
from tide import _core

if not getattr(_core, "built_with_cuda", False):
    pytest.skip("tide._core built without CUDA", allow_module_level=True)

SHAPES = [(37, 16), (5,), (64, 3, 8), (9, 40)]


def _sets(M, L):
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), tide.Topology(M, L))
    sets = {"ag": _core.build_ag_programs(plan), "rs0": _core.build_rs_programs(plan, bank=0),
            "rs1": _core.build_rs_programs(plan, bank=1, alpha=0.5, accumulate=True)}
    if M > 1:  # the shape of tests/test_cuda_host_processes.py [2-2]: other nodes over rails
        sets["ag_rails"] = _core.build_ag_programs(plan, head_bytes=16).lowered()
        sets["rs_rails"] = _core.build_rs_programs(plan, bank=0).lowered()
    return sets


def _global_order(ps, ranks, seqs):
    """The one order restricted to `ranks`: per call, each rank's entry, each rank's fence
    waits, then the walk's visits of those ranks (the walk of every rank local)."""
    out = []
    for c in _core.testing.enqueue_orders(ps, [], seqs):
        assert c["stalled"] == (False, False)
        seq = c["seq"]
        for phase in ("entry", "fence"):
            out += [(seq, phase, r, 0, 0, 0) for r in sorted(ranks)]
        out += [(seq, "op", r, s, k, end) for r, s, k, end in c["walk"] if r in ranks]
    return out


@pytest.mark.parametrize("M,L,ranks", [(2, 2, [0, 1]), (2, 2, [2, 3]), (1, 4, [0, 1]), (1, 4, [3, 1]),
                                       (2, 4, [0, 1, 2, 3])])
def test_gated_ranks_of_a_process_enqueue_the_one_global_order(M, L, ranks):
    seqs = [1, 2, 3]
    for name, ps in _sets(M, L).items():
        want = _global_order(ps, ranks, seqs)
        for late in range(len(ranks)):  # each thread in turn starts every call 20 ms after the others
            delays = [0.02 if i == late else 0.0 for i in range(len(ranks))]
            log, errors = _core.testing.issue_turns_orders(ps, ranks, seqs, True, delays)
            assert errors == [""] * len(ranks), (name, errors)
            assert log == want, (name, ranks, late)


def test_without_the_gate_a_late_thread_enqueues_out_of_the_global_order():
    """What the gate prevents: the ranks' steps interleave in the global order (a rank's waits on
    its peer's counters between the peer's steps), so a thread that starts late enqueues its
    producers after the waits the other thread already enqueued."""
    ps = _sets(2, 2)["rs_rails"]
    want = _global_order(ps, [0, 1], [1, 2])
    log, errors = _core.testing.issue_turns_orders(ps, [0, 1], [1, 2], False, [0.0, 0.1])
    assert errors == ["", ""]
    assert sorted(log) == sorted(want) and log != want
    first_of_1 = next(i for i, s in enumerate(log) if s[2] == 1)
    assert all(s[2] == 0 for s in log[:first_of_1]) and first_of_1 >= sum(s[2] == 0 and s[0] == 1 for s in want)


def test_a_rank_whose_thread_never_comes_fails_the_waiting_rank_naming_it():
    ps = _sets(2, 2)["rs_rails"]
    log, errors = _core.testing.issue_turns_orders(ps, [0, 1], [1], True, [0.0, -1.0], deadline_s=0.2)
    assert errors[1] == ""  # never ran
    assert "same-process issue gate" in errors[0] and "rank 1 of this process did not enqueue its step 1" in errors[0]
    assert "issue_gate=0" in errors[0]
    assert log == [(1, "entry", 0, 0, 0, 0)]  # its own entry, then it waited for rank 1's


def test_issue_gate_is_an_executor_option_and_a_debug_override(monkeypatch):
    assert tide.ExecutorOptions().issue_gate is True
    assert "issue_gate=0" in _core.executor_options({"issue_gate": False})
    monkeypatch.setenv("TIDE_EXEC_OPTIONS", "issue_gate=0")
    assert "issue_gate=0" in tide.ExecutorOptions().effective()
    monkeypatch.setenv("TIDE_EXEC_OPTIONS", "issue_gate=maybe")
    with pytest.raises(tide.PlanError, match="TIDE_EXEC_OPTIONS: issue_gate: expected 0/1"):
        tide.ExecutorOptions().effective()
