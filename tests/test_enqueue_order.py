"""The CUDA issue path's enqueue order on the host (no GPU): the walk of [Note: enqueue order]
against the same call replayed from the set's recorded walk ([Note: replayed enqueue order],
exec/cuda/enqueue_order.h). Both run the executors' code over every builder's program sets on
several topologies, as the in-process executor (every rank local) and as each rank executor's
view (one local rank), each call on its own counter mirror: the replay must visit the same ops
in the same order and leave the same mirror, and from the second call on it must come whole
from the record (the saving), while a call whose gates differ hands over to the walk."""
import pytest

import tide
from tide import _core

if not getattr(_core, "built_with_cuda", False):
    pytest.skip("tide._core built without CUDA", allow_module_level=True)

SHAPES = [(37, 16), (5,), (64, 3, 8), (9, 40), (3, 7), (128, 24)]


def _sets(M, L):
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), tide.Topology(M, L))
    sets = {"ag": _core.build_ag_programs(plan),
            "ag_cast": _core.build_ag_programs(plan, resident=False, with_expects=False),
            "rs0": _core.build_rs_programs(plan, bank=0),
            "rs1": _core.build_rs_programs(plan, bank=1, alpha=0.5, accumulate=True)}
    if L == 1:
        sets["rs_expert"] = _core.build_rs_programs(plan, bank=0, expert_lane=True)
        sets["ag_expert"] = _core.build_ag_programs(plan, expert_lane=True)
    if M > 1:
        sets["ag_rails"] = _core.build_ag_programs(plan, head_bytes=16).lowered()
        sets["rs_rails"] = _core.build_rs_programs(plan, bank=0).lowered()
    return sets


def _ops(ps, n):
    return sum(len(ps.describe(r)) for r in range(n))


@pytest.mark.parametrize("M,L", [(1, 2), (1, 8), (2, 2), (2, 4), (3, 2), (4, 1)])
def test_replayed_order_is_the_walks_order(M, L):
    n = M * L
    for name, ps in _sets(M, L).items():
        for local in ([], [0], [n - 1]):
            calls = _core.testing.enqueue_orders(ps, local, [1, 2, 3, 4])
            for c in calls:
                what = (name, local, c["seq"])
                assert c["walk"] == c["replay"], what
                assert c["mirrors_equal"], what
                assert c["stalled"] == (False, False) and c["trusted_remote"] == (False, False), what
                # every op of every rank is visited once (rail groups as one visit)
                visited = sum(end - k for _, _, k, end in c["walk"])
                assert visited == _ops(ps, n), what
                assert c["record_steps"] >= len(c["walk"]), what
            assert calls[0]["replayed_steps"] == 0 and not calls[0]["deviated"]  # nothing recorded yet
            for c in calls[1:]:  # steady state: the whole call from the record
                assert not c["deviated"] and c["replayed_steps"] == c["record_steps"], (name, local, c["seq"])


def test_a_call_whose_gates_differ_hands_over_to_the_walk():
    """seq 1 again after seq 4: every target is already met, so waits the record found blocked
    pass; the walk takes over at the first such gate and the order is still the walk's."""
    for name, ps in _sets(2, 4).items():
        calls = _core.testing.enqueue_orders(ps, [1], [1, 2, 3, 4, 1, 2])
        again = calls[4]
        assert again["deviated"], name
        assert again["replayed_steps"] < calls[3]["record_steps"], name
        for c in calls:
            assert c["walk"] == c["replay"] and c["mirrors_equal"], (name, c["seq"])


@pytest.mark.parametrize("local", [[], [0], [1]])
def test_a_stall_is_the_walks_stall_and_leaves_no_record(local):
    """A dropped credit: the walk stalls (all local: the enqueue-time TimeoutError; one local rank:
    it trusts remote producers). The replayed call stalls or trusts at the same point, and a call
    that stalled or trusted leaves no record to replay."""
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), tide.Topology(3, 2))
    ps = _core.build_ag_programs(plan, resident=False, with_expects=False).copy()
    assert ps.inject_fault(_core.fault_kinds["drop_credit"], 1)
    calls = _core.testing.enqueue_orders(ps, local, [1, 2, 3])
    assert calls[0]["stalled"] == (False, False) and calls[0]["record_steps"] > 0  # the credit is needed from call 2
    for c in calls[1:]:
        assert c["walk"] == c["replay"] and c["mirrors_equal"]
        assert c["stalled"][0] == c["stalled"][1] and c["trusted_remote"][0] == c["trusted_remote"][1]
        assert c["stalled"][0] or c["trusted_remote"][0]
        assert c["stalled"][0] == (local == [])
        assert c["record_steps"] == -1


def _rail_groups_walked(ps, walk, M, L):
    """Per node, the walk's rail groups of its ranks in order, as (local index, rail_group)."""
    import re
    ops = {}
    for r in range(M * L):
        names, by_stream = ps.streams(r), {}
        for line in ps.describe(r):
            m = re.match(r"(\d+) (\w+) \[(\w+)\]", line)
            by_stream.setdefault(names.index(m.group(3)), []).append((m.group(2), line))
        ops[r] = by_stream
    per_node = [[] for _ in range(M)]
    for r, s, k, _end in walk:
        kind, line = ops[r][s][k]
        if kind in ("SEND", "RECV"):
            per_node[r // L].append((r % L, int(re.search(r"rail_group=(\d+)", line).group(1))))
    return per_node


@pytest.mark.parametrize("M,L", [(2, 2), (2, 4), (3, 2)])
def test_every_node_walks_its_rail_groups_in_the_same_order(M, L):
    """A rail group completes only while its peers' groups run too, so the argument of [Note:
    enqueue order] needs every process (node) to enqueue the rendezvous in the same relative
    order: the walk visits each node's rail groups in one (local index, group) sequence."""
    for name, ps in _sets(M, L).items():
        if "rails" not in name:
            continue
        for c in _core.testing.enqueue_orders(ps, [], [1, 2, 3]):
            nodes = _rail_groups_walked(ps, c["walk"], M, L)
            assert nodes[0] and all(n == nodes[0] for n in nodes), (name, c["seq"])
