"""The pull landing run on the CPU virtual cluster ([Note: pull landing] in tide/program.h; across
nodes [Note: pull landing across nodes] in csrc/program/ag_program.cc): every rank's own landing
buffers (D_p rows, poisoned before each call) hold, bit for bit, the rows [0, D_p) the push program
lands in its ring slot, for integer data over calls seq 1..3, on one-sided and two-sided rails; the
pull programs fit the push programs' counters and arena."""
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


@pytest.mark.parametrize("M,L", [(2, 2), (4, 2), (2, 1), (3, 2), (2, 4), (8, 1)])
def test_pull_programs_fit_the_push_programs_counters_and_arena(M, L):
    """The faces size a pulled group's arena, segments and counter ranges as the push program's
    (program_counters / session_arena / rank_arena build no pull programs): the pull programs'
    counters fit them on one- and two-sided rails, in the same arena layout."""
    _, plan = make_plan(M, L, shapes=SHAPES, shard_dtype="float32")
    pull = _core.build_ag_programs(plan, resident=False, pull_landing=True, with_expects=False)
    push = _core.build_ag_programs(plan, resident=False, with_expects=False)
    assert pull.arena_bytes() == push.arena_bytes()
    assert pull.num_counters <= _core.program_counters(plan, "all_gather", "one_sided")
    assert pull.lowered().num_counters <= _core.program_counters(plan, "all_gather", "two_sided")
