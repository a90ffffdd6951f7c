"""Two-sided rails ([Note: two-sided rails] in tide/program.h): the lowering of every builder's
programs to SEND/RECV rendezvous groups, the checker's proof of them and its four rail fault
kinds, and the CPU virtual cluster running them bit-identically to the one-sided programs."""
import re

import ml_dtypes
import numpy as np
import pytest

import tide
from tide import _core
from tide.plan import rs_bank

from ag_helpers import make_fulls, make_plan, shard
from test_rs_programs import GRID, make, shapes_for

BF16 = np.dtype(ml_dtypes.bfloat16)
FAULT = _core.fault_kinds
SMALL = [(5, 3), (9,)]
REF = re.compile(r"@(\d+)")


def _lowered_rs(plan, expert_lane=False):
    return {b: _core.build_rs_programs(plan, bank=b, expert_lane=expert_lane).lowered() for b in (0, 1)}


def _rs_calls(sets, N, n_calls=3):
    return [[(sets[rs_bank(s)], s) for s in range(1, n_calls + 1)] for _ in range(N)]


def _cross_node_ops(ps, L):
    """Ops of any rank that reach another node other than through SEND/RECV (describe() text)."""
    bad = []
    for r in range(len(ps)):
        for d in ps.describe(r):
            kind = d.split()[1]
            if kind in ("SEND", "RECV"):
                continue
            if any(int(x) // L != r // L for x in REF.findall(d)):
                bad.append((r, d))
    return bad


@pytest.mark.parametrize("L", [1, 2, 4, 8])
def test_checker_accepts_lowered_ag_grid(L):
    for M in [*range(1, 17), 64]:
        for cast in (False, True):
            _, plan = make_plan(M, L, shapes=SMALL if M < 64 else [(3,)], shard_dtype="float32" if cast else None)
            for head_bytes in (16, 0):  # 0: the plan's head (every tail PUT empty at these sizes)
                one = _core.build_ag_programs(plan, resident=not cast, head_bytes=head_bytes)
                ps = one.lowered()
                assert ps.rails == "two_sided" and one.rails == "one_sided"
                ok, errors = ps.check(2)
                assert ok, (M, L, cast, head_bytes, errors)
                if M > 1 and M < 64:
                    assert not _cross_node_ops(ps, L), _cross_node_ops(ps, L)[:2]
                    assert sum(d.split()[1] == "SEND" for d in ps.describe(0)) >= 1
                    assert not any(d.split()[1] == "PUT" for r in range(M * L) for d in one.lowered().describe(r)
                                   if any(int(x) // L != r // L for x in REF.findall(d)))


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 16, 64])
def test_checker_accepts_lowered_expert_lanes(M):
    _, plan = make_plan(M, 1, shapes=SMALL)
    ok, errors = _core.build_ag_programs(plan, expert_lane=True).lowered().check(3)
    assert ok, errors
    ok, errors = _core.check_calls(_rs_calls(_lowered_rs(plan, expert_lane=True), M))
    assert ok, errors


@pytest.mark.parametrize("M,L,mode,kw", GRID, ids=lambda v: str(v))
def test_checker_accepts_lowered_rs_grid(M, L, mode, kw):
    plan = make(M, L, mode, **kw)
    sets = _lowered_rs(plan)
    ok, errors = _core.check_calls(_rs_calls(sets, M * L))
    assert ok, errors
    if 1 < M < 64:
        assert not _cross_node_ops(sets[0], L)


def test_lowering_moves_credits_to_the_receiver_and_keeps_one_producer():
    """A rank's credit to its sender becomes a local counter its own rail_p2p stream waits on,
    and the arrival counter is bumped by the receiver's RECV (single producer)."""
    _, plan = make_plan(2, 1, shapes=SMALL)
    ps = _core.build_ag_programs(plan, head_bytes=16).lowered()
    assert ps.streams(0)[-1] == "rail_p2p"
    ops = ps.describe(0)
    recv = [d for d in ops if " RECV " in d]
    assert recv and all("[rail_p2p]" in d and re.search(r"counter=(HEAD|TAIL)\[0\]@0 ", d) for d in recv)
    rail = ps.streams(0).index("rail_p2p")
    head0 = 2 * 1 + 0  # HEAD[0] at L = 1 ([Note: AG streams and counters]: READY[L], DONE[L], HEAD[R], ...)
    assert _core.build_ag_programs(plan, head_bytes=16).producer(0, head0) == (1, 0)  # one-sided: the sender's PUT
    assert ps.producer(0, head0) == (0, rail)                                        # two-sided: own RECV
    waits = [d for d in ops if "[rail_p2p]" in d and " WAIT " in d and "counter=rail:CREDIT[0] of rank" in d]
    assert waits, "the credit wait moved to the receiver's rail stream"
    assert not any("[caller]" in d and "CreditWait" in d for d in ops), "no sender-side credit wait remains"
    assert rail == 4


@pytest.mark.parametrize("name,message", [
    ("drop_recv", "R rail dropped receive"),
    ("split_rail_group", "R rail group split"),
    ("swap_rail_groups", "R rail|I4 deadlock"),
    ("rail_size_mismatch", "R rail size mismatch"),
])
def test_rail_faults_are_rejected(name, message):
    # AG at 2 x 2: one group (a round's head and tail between the same pair of nodes); swapping
    # needs two groups: 4 x 2 (two rounds).
    _, plan = make_plan(4 if name == "swap_rail_groups" else 2, 2, shapes=SMALL)
    ps = _core.build_ag_programs(plan, head_bytes=16).lowered()
    assert ps.check(2)[0]
    assert ps.inject_fault(FAULT[name], 1)
    ok, errors = ps.check(2)
    assert not ok and any(re.search(message, e) for e in errors), errors
    # RS at 2 x 1 and 3 x 2, both banks mutated alike.
    for M, L in ((2, 1), (3, 2)):
        sets = _lowered_rs(make(M, L))
        hit = [sets[b].inject_fault(FAULT[name], 1) for b in (0, 1)]
        if not all(hit):
            assert name in ("split_rail_group", "swap_rail_groups")  # one transfer per group / call
            continue
        ok, errors = _core.check_calls(_rs_calls(sets, M * L))
        assert not ok and any(re.search(message, e) for e in errors), (M, L, errors)


def test_rail_messages_name_ranks_ops_and_groups():
    _, plan = make_plan(2, 2, shapes=SMALL)
    ps = _core.build_ag_programs(plan, head_bytes=16).lowered()
    ps.inject_fault(FAULT["drop_recv"], 3)
    ok, errors = ps.check(2)
    dropped = [e for e in errors if "dropped receive" in e]
    assert dropped and re.search(r"rank 3 posts \d+ receive\(s\) from rank 1", dropped[0])
    assert re.search(r"rank 1 call seq \d+ \(group 0\) op \d+ SEND \[rail_p2p\] round 0 group \d+", dropped[0])


def _bits(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize("M,L,cast", [(2, 1, False), (2, 2, False), (3, 2, True), (4, 1, False), (5, 2, False)])
def test_two_sided_all_gather_is_bit_identical(M, L, cast):
    shapes = [(5 * M * L + 3, 8), (7,)]
    topo, plan = make_plan(M, L, shapes=shapes, shard_dtype="float32" if cast else None)
    fulls = make_fulls(shapes, "int", M * L, dtype=np.float32 if cast else BF16)
    shards = shard(fulls, plan, M * L)
    out = {}
    for rails in ("one_sided", "two_sided"):
        vc = tide.VirtualCluster(topo, rails=rails, timeout_s=20)
        out[rails] = [vc.all_gather(plan, shards, poison=True) for _ in range(2)]
        s, _ = vc._latest[(plan.hash, "all_gather")]
        assert s.programs("all_gather", 1).rails == rails
    for a, b in zip(out["one_sided"], out["two_sided"]):
        for ra, rb in zip(a, b):
            assert all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(ra, rb))
    for r in range(M * L):  # and equal to the unsharded parameters
        for p, f in enumerate(fulls):
            assert np.array_equal(_bits(out["two_sided"][1][r][p]), _bits(f.astype(BF16)))


@pytest.mark.parametrize("M,L,mode,kw", [
    (2, 1, "in_place", {}), (2, 2, "slot_reuse", {}), (3, 2, "in_place", {}),
    (5, 2, "slot_reuse", {"k": 1}), (4, 4, "in_place", {"chunk_bytes": 8, "n_stg": 1}),
    (3, 8, "slot_reuse", {"chunk_bytes": 16, "n_stg": 3, "n_part": 2}),
])
def test_two_sided_reduce_scatter_is_bit_identical(M, L, mode, kw):
    plan = make(M, L, mode, **kw)
    rng = np.random.default_rng(M * 10 + L)
    grads = [[rng.standard_normal(s).astype(BF16) for s in shapes_for(M, L, kw.get("n_part", 1))]
             for _ in range(M * L)]
    out = {}
    for rails in ("one_sided", "two_sided"):
        vc = tide.VirtualCluster(tide.Topology(M, L), rails=rails, timeout_s=20)
        out[rails] = [vc.reduce_scatter(plan, grads, poison=True) for _ in range(3)]
    for a, b in zip(out["one_sided"], out["two_sided"]):
        assert all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("M", [2, 9])
def test_two_sided_expert_lanes_are_bit_identical(M):
    shapes = [(5 * M + 3, 8), (7,), (12 * M, 6)]
    plan = tide.plan(tide.GroupSignature(shapes=shapes), tide.Topology(M, 1))
    rng = np.random.default_rng(M)
    grads = [[rng.integers(-16, 16, size=s).astype(BF16) for s in shapes] for _ in range(M)]
    fulls = make_fulls(shapes, "int", 3)
    shards = shard(fulls, plan, M)
    out = {}
    for rails in ("one_sided", "two_sided"):
        vc = tide.VirtualCluster(tide.Topology(M, 1), rails=rails, timeout_s=20)
        out[rails] = (vc.reduce_scatter_expert(plan, grads), vc.all_gather(plan, shards, expert_lane=True))
    assert all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(out["one_sided"][0], out["two_sided"][0]))
    for ra, rb in zip(out["one_sided"][1], out["two_sided"][1]):
        assert all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(ra, rb))


def test_a_dead_peer_fails_every_survivor_with_a_diagnosis():
    topo, plan = make_plan(2, 2, shapes=SMALL)
    shards = shard(make_fulls(SMALL, "int", 1), plan, 4)
    vc = tide.VirtualCluster(topo, rails="two_sided", timeout_s=1.0)
    vc.faults = dict(dead_rank=3, dead_op=0)
    with pytest.raises(tide.TimeoutError, match=r"rail group \d+ \((SEND to|RECV from) rank 3.*did not complete.*"
                                                 r"rail is aborted|waits for counter"):
        vc.all_gather(plan, shards)


def test_rails_option_is_validated_by_name():
    with pytest.raises(tide.PlanError, match="VirtualCluster.rails"):
        tide.VirtualCluster(tide.Topology(2, 1), rails="both")
    with pytest.raises(tide.PlanError, match="rails"):
        tide.ExecutorOptions(rails="rdma")
    with pytest.raises(tide.PlanError, match="ranks_as='threads'"):
        tide.VirtualCluster(tide.Topology(2, 1), ranks_as="processes", rails="two_sided")
    with pytest.raises(tide.PlanError, match="CPU backend"):
        tide.VirtualCluster(tide.Topology(2, 1), backend="cuda", rails="two_sided")
    assert tide.ExecutorOptions(rails="two_sided").rails == "two_sided"


def test_two_sided_counters_are_reserved_for_the_lowered_programs():
    _, plan = make_plan(3, 2, shapes=SMALL)
    one = _core.program_counters(plan, "all_gather")
    two = _core.program_counters(plan, "all_gather", rails="two_sided")
    ps = _core.build_ag_programs(plan).lowered()
    assert two == ps.num_counters > one
    space = _core.CounterSpace()
    assert space.reserve(plan, "reduce_scatter", rails="two_sided") == 0
    assert space.used == _core.build_rs_programs(plan).lowered().num_counters


@pytest.mark.parametrize("M,L", [(2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("mode", ["in_place", "slot_reuse"])
def test_one_rail_group_per_bruck_round(M, L, mode):
    """The 70B block on emulated hosts: a Bruck round's head and tail PUTs (adjacent on the
    caller stream, contiguous) post as one group, one SEND per peer; RS keeps one group per
    wave transfer (a sent event and a credit separate them). Prints what each rank posts per call."""
    from tide import models
    plan = tide.plan(models.signature("llama3.1-70b", "block", shard_dtype="float32"), tide.Topology(M, L),
                     mode=mode)
    one = _core.build_ag_programs(plan, resident=False)
    ag = one.lowered()
    rs = _lowered_rs(plan)
    assert one.rail_stats(0) == dict(groups=0, sends=0, recvs=0, send_messages=0, send_bytes=0)
    rounds = (M - 1).bit_length()  # ceil(log2 M)
    for r in range(M * L):
        cross = [d for d in one.describe(r) if " PUT " in d and any(int(x) // L != r // L for x in REF.findall(d))]
        st = ag.rail_stats(r)
        assert len(cross) == 2 * rounds  # head and tail of every round
        assert st["groups"] == st["sends"] == st["recvs"] == rounds
        assert st["send_bytes"] == sum(int(w) for d in cross for w in re.findall(r" (\d+)x1\}", d))
        for b in (0, 1):
            s = rs[b].rail_stats(r)
            assert s["groups"] == s["sends"] == s["recvs"] == s["send_messages"] > 0
    ok, errors = ag.check(2)
    assert ok, errors
    st, s = ag.rail_stats(0), rs[0].rail_stats(0)
    print(f"\n{M}x{L} {mode}: AG {st['groups']} groups / {st['sends']} SENDs / {st['send_messages']} messages "
          f"per rank per call (one-sided: {2 * rounds} cross-node PUTs); RS {s['groups']} / {s['sends']} / "
          f"{s['send_messages']}")
