"""The pull landing run on the CPU virtual cluster ([Note: pull landing] in tide/program.h; across
nodes [Note: pull landing across nodes] in csrc/program/ag_program.cc): every rank's own landing
buffers (D_p rows, poisoned before each call) hold, bit for bit, the rows [0, D_p) the push program
lands in its ring slot, for integer data over calls seq 1..3, on one-sided and two-sided rails; a
pulled session's arena holds what the pull programs touch: the stage and their counters."""
import numpy as np
import pytest

import tide
from tide import _core
from ag_helpers import BF16, make_fulls, make_plan, reference, same_bits, shard

SHAPES = [(37, 8), (16,), (5, 3), (3,)]  # (3,): the last ranks hold only padding rows
KIND = dict(_core.buf_kinds)


def pull_all_gather(vc, plan, shards):
    """shards[r][p] (fp32, padded) -> landings[r][p] (bf16, D_p rows) through the pull programs."""
    lay, N = plan.layout, vc.world
    shapes = _core.plan_shapes(plan)
    s, _ = vc.session(plan, "all_gather", resident=False, pull_landing=True)
    landings, bindings, keep = [], [], []
    for r in range(N):
        rows = []
        b = []
        for p, pl in enumerate(lay.params):
            x = np.ascontiguousarray(shards[r][p], dtype=np.float32).reshape(-1)
            out = np.full(pl.D * pl.K, 0xFFFF, dtype=np.uint16).view(BF16)  # poisoned: NaN bits
            keep += [x, out]
            b += [(KIND["shard"], p, x.ctypes.data, x.nbytes), (KIND["landing"], p, out.ctypes.data, out.nbytes)]
            rows.append(out.reshape(shapes[p]))
        landings.append(rows)
        bindings.append(b)
    s.all_gather(bindings)
    ps = s.programs("all_gather", 1, 1.0, False)  # the set that ran: pulls only, on the cluster's rails
    assert ps.rails == vc.options.rails and all(
        "tag=Pull" in "".join(ps.describe(r)) and "Push" not in "".join(ps.describe(r)) for r in range(N))
    return landings


@pytest.mark.parametrize("rails", ["one_sided", "two_sided"])
@pytest.mark.parametrize("M,L,shapes", [(2, 2, SHAPES), (4, 2, SHAPES), (2, 1, SHAPES), (3, 2, SHAPES),
                                        (9, 1, [(72, 3), (13,)])])  # 9 x 1: strided pulls (runs of 4)
def test_pull_landing_equals_the_push_landing(M, L, shapes, rails):
    N = M * L
    topo, plan = make_plan(M, L, shapes=shapes, shard_dtype="float32")
    vc = tide.VirtualCluster(topo, timeout_s=20, rails=rails)  # checks every new program set
    for seq in (1, 2, 3):  # each call its own data; the push program alternates ring slots
        fulls = make_fulls(shapes, "int", seed=10 * M + seq, dtype=np.float32)
        shards = shard(fulls, plan, N)
        pushed = vc.all_gather(plan, shards, resident=False, ring_slot=seq % 2, poison=True)
        pulled = pull_all_gather(vc, plan, shards)
        want = reference(fulls)
        for r in range(N):
            for p in range(len(shapes)):
                assert same_bits(pulled[r][p], pushed[r][p]), (seq, r, p)
                assert same_bits(pulled[r][p], want[p]), (seq, r, p)


def test_strided_pulls_appear_where_runs_are_long():
    _, plan = make_plan(9, 1, shapes=[(72, 3)], shard_dtype="float32")
    ps = _core.build_ag_programs(plan, resident=False, pull_landing=True)
    pulls = [d for d in ps.describe(0) if "tag=Pull" in d]
    assert any("x4}" in d for d in pulls), pulls  # round 2 delivers nodes 4..7: one 2-D copy


RS_SCRATCH = ("staging", "outbox", "inbox", "spare")


def align(n, a=4096):
    return -(-n // a) * a


def touched(ps):
    """{region: end byte} any rank's program of `ps` addresses (the program index's arena_end)."""
    ends = {}
    for r in range(len(ps)):
        for name, end in ps.arena_ends(r).items():
            ends[name] = max(ends.get(name, 0), end)
    return ends


@pytest.mark.parametrize("rails", ["one_sided", "two_sided"])
@pytest.mark.parametrize("M,L", [(1, 2), (1, 8), (2, 2), (4, 2), (2, 1), (3, 2), (2, 4), (8, 1)])
def test_pulled_session_arena_holds_what_the_pull_programs_touch(M, L, rails):
    """A pulled all-gather's own arena ([Note: pulled arena] in tide/plan.h) is the stage its pull
    programs address (the program index's region ends, every rank) and exactly their counters on
    the rails in use: no ring slots, no TIDE-RS regions; the programs are bound to that layout, and
    the memory model reports the same bytes."""
    _, plan = make_plan(M, L, shapes=SHAPES, shard_dtype="float32")
    pull = _core.build_ag_programs(plan, resident=False, pull_landing=True, with_expects=False)
    if rails == "two_sided":
        pull = pull.lowered()
    ends = touched(pull)
    assert set(ends) == {"stage"}, ends  # the pulls land in the user's buffers: no ring slot touched
    regions, total = _core.session_arena(plan, ["all_gather"], rails, pull_landing=True)
    for name in ("ring0", "ring1", "resident") + RS_SCRATCH:
        assert regions[name][1] == 0, (name, regions)
    assert regions["stage"] == (0, ends["stage"])
    n = pull.num_counters
    assert n == _core.program_counters(plan, "all_gather", rails, pull_landing=True)
    assert n == _core.program_counters(plan, "all_gather", rails)  # the push programs' range: the same
    assert regions["counters"] == (align(ends["stage"]), 8 * n)
    assert total == align(ends["stage"]) + 8 * n
    assert pull.arena_layout() == regions and pull.arena_bytes() == total
    mem = plan.memory()  # the closed form: one-sided counters
    n1 = _core.program_counters(plan, "all_gather", "one_sided")
    assert mem["pull_arena"] == [{"name": "stage", "offset": 0, "bytes": ends["stage"]},
                                 {"name": "counters", "offset": align(ends["stage"]), "bytes": 8 * n1}]
    assert mem["pull_arena_bytes"] == total - 8 * (n - n1)
    # What it no longer holds: both ring slots (2 NS) and the TIDE-RS scratch, at least.
    full = _core.session_arena(plan, ["all_gather"], rails)[1]
    assert full - total >= mem["ring_bytes"] + mem["area_rs_bytes"]


@pytest.mark.parametrize("rails", ["one_sided", "two_sided"])
def test_pulled_session_runs_in_its_arena(rails):
    """The virtual cluster's pulled session runs in the pulled arena (its executor's arena is that
    layout, refused otherwise: CpuClusterExecutor.run compares them) and lands the push bytes."""
    M, L = 2, 2
    topo, plan = make_plan(M, L, shapes=SHAPES, shard_dtype="float32")
    vc = tide.VirtualCluster(topo, timeout_s=20, rails=rails)
    fulls = make_fulls(SHAPES, "int", seed=5, dtype=np.float32)
    pulled = pull_all_gather(vc, plan, shard(fulls, plan, M * L))
    _, total = _core.session_arena(plan, ["all_gather"], rails, pull_landing=True)
    assert vc.arena(plan).bytes_per_rank == total
    for r in range(M * L):
        for p in range(len(SHAPES)):
            assert same_bits(pulled[r][p], reference(fulls)[p]), (r, p)


def test_pulled_arena_is_tide_ag_alone():
    _, plan = make_plan(2, 2, shapes=SHAPES, shard_dtype="float32")
    with pytest.raises(_core.PlanError, match="pull_landing is TIDE-AG's and its arena is its own"):
        _core.session_arena(plan, ["all_gather", "reduce_scatter"], pull_landing=True)
    with pytest.raises(_core.PlanError, match="program_counters: pull_landing is TIDE-AG's"):
        _core.program_counters(plan, "reduce_scatter", pull_landing=True)
