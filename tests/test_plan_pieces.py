"""The framework-free pieces the faces plan with (tide.plan, tide.ranks, tide.regions):
chunks of a large group, the re-gather plan over a sub-group that lands where the group's plan
lands, a sub-plan that must fit an arena already laid out, node-major sub-groups, the record
verdict, and the region layout."""
from __future__ import annotations

import pytest

import tide
from tide import ranks, regions
from tide.plan import MAX_PARAMS, RS_SCRATCH, plan_chunks, plan_fitting, regather_plan, region_bytes

TOPO = tide.Topology(nodes=2, gpus_per_node=2)


def _sig(shapes, grad="bfloat16"):
    return tide.GroupSignature(shapes=shapes, ag_dtype="bfloat16", grad_dtype=grad,
                               shard_dtype="float32", names=tuple(f"p{i}" for i in range(len(shapes))))


def test_chunks_are_the_slices_planned_alone():
    shapes = [(37, 16), (16,), (24, 16)] * 100  # 300 parameters
    chunks = plan_chunks(_sig(shapes), TOPO)
    assert [(first, len(p.layout.params)) for first, p in chunks] == [(0, MAX_PARAMS), (256, 44)]
    for first, p in chunks:
        alone = tide.plan(_sig(shapes[first:first + MAX_PARAMS]), TOPO)
        assert p.hash != 0 and [q.R for q in p.layout.params] == [q.R for q in alone.layout.params]
        assert [p.layout.landing(i, 1) for i in range(len(p.layout.params))] == \
            [alone.layout.landing(i, 1) for i in range(len(alone.layout.params))]
    with pytest.raises(tide.PlanError, match="exceed TIDE's limit of 256"):
        tide.plan(_sig(shapes), TOPO)


def test_regather_plan_lands_where_the_group_lands():
    base = tide.plan(_sig([(37, 16), (16,), (5, 3)]), TOPO)  # N = 4: R = 10, 4, 2
    sub = regather_plan(base, tide.Topology(nodes=1, gpus_per_node=2))
    assert [q.R for q in sub.layout.params] == [2 * q.R for q in base.layout.params]
    for i in range(3):
        assert sub.layout.landing(i, 0) == base.layout.landing(i, 0)
        # sub-rank r' holds base ranks 2r' and 2r'+1's rows
        assert sub.layout.landing(i, 1) == base.layout.landing(i, 2)
    assert sub.ag_dtype == sub.shard_dtype == "bfloat16"  # post-forward shards: no cast
    assert regather_plan(base, tide.Topology(nodes=1, gpus_per_node=3)) is None  # 3 does not divide 4


def test_plan_fitting_names_what_does_not_fit():
    sig = _sig([(37, 16), (16,)])
    whole = tide.plan(_sig([(37, 16), (16,), (24, 16)], grad="float32"), TOPO)
    room = {n: region_bytes(whole, n) for n in RS_SCRATCH}
    space = tide._core.CounterSpace()
    space.reserve(whole, "reduce_scatter")
    p = plan_fitting(sig, TOPO, "in_place", {}, counters=space.used, regions=room)
    assert len(p.layout.params) == 2
    with pytest.raises(tide.PlanError, match=r"needs \d+ counters, a reserved range holds 3"):
        plan_fitting(sig, TOPO, "in_place", {}, counters=3, regions=room)
    with pytest.raises(tide.PlanError, match=r"its staging needs \d+ B, the arena holds 0 B"):
        plan_fitting(sig, TOPO, "in_place", {}, counters=space.used, regions={**room, "staging": 0})


def test_node_major_sub_groups_and_the_verdict():
    assert ranks.group_topology([0, 2], TOPO) == tide.Topology(nodes=2, gpus_per_node=1)
    assert ranks.group_topology([0, 1], TOPO) == tide.Topology(nodes=1, gpus_per_node=2)
    assert ranks.group_topology([1, 0], TOPO) is None            # not node-major
    assert ranks.group_topology([0, 1, 2], TOPO) is None          # uneven nodes
    assert ranks.node_host_problem(["a", "a", "b", "b"], TOPO) is None
    assert "ranks 2 and 3 of topology node 1" in ranks.node_host_problem(["a", "a", "b", "c"], TOPO)
    rec = {"rank": 0, "error": None, "topology": (2, 2), "groups": [("layers.0", "tide:1")]}
    assert ranks.verdict([rec, {**rec, "rank": 1}], ("topology",)) == []
    assert ranks.verdict([rec, {**rec, "rank": 1, "error": "boom"}], ("topology",)) == ["rank 1 failed: boom"]
    assert ranks.verdict([rec, {**rec, "rank": 1, "groups": []}], ("topology",), groups="FSDP groups") == \
        ["rank 1 has 0 FSDP groups but rank 0 has 1"]
    assert ranks.verdict([rec, {**rec, "rank": 1, "topology": (1, 4)}], ("topology",)) == \
        ["rank 1 has topology (1, 4) but rank 0 has (2, 2)"]


def test_await_keys_names_who_is_late():
    store = {"k/0": "a", "k/2": "c"}
    listing = lambda prefix: [(k, v) for k, v in store.items() if k.startswith(prefix)]  # noqa: E731
    assert ranks.await_keys(listing, "k", [0, 2], 100, lambda m: TimeoutError(m)) == {0: "a", 2: "c"}
    with pytest.raises(TimeoutError, match=r"\[1\]"):
        ranks.await_keys(listing, "k", [0, 1, 2], 20, lambda m: TimeoutError(str(m)))


def test_region_layout():
    got = regions.layout({"ring0": 1000, "ring1": 0, "fixed": 300})
    assert [(r.name, r.offset, r.nbytes) for r in got.values()] == \
        [("ring0", 0, 1024), ("ring1", 1024, 0), ("fixed", 1024, 512)]
    assert regions.arena_nbytes({"a": 0}) == regions.ALIGN
