"""tide_torch feature coverage on world 4 (CPU, gloo ranks as processes), each against stock FSDP2
on identical per-rank data (exact gradient sums, so results must be bitwise equal):

(c) the profiler sees no split_with_sizes_copy / _chunk_cat / all_gather_copy_in;
(e) gradient accumulation without sync (both modes), reshard_after_forward False and int, and
    the folded ring tail (last block not resharding).
"""
from __future__ import annotations

import torch

import tide
from _torch_dist import assert_same, batches, build, mesh_1d, spawn, train

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
BANNED = ("split_with_sizes_copy", "_chunk_cat", "chunk_cat", "all_gather_copy_in")


def _profile_and_variants(rank, world):
    import tide_torch
    mesh = mesh_1d()
    data = batches(4, same_on_all_ranks=True)

    # (c) profiler: no copy-in / copy-out / packing ops for TIDE groups.
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data[:1])  # first step builds the unsharded parameters
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(model, data[1:2])
    names = {e.name for e in prof.events()}
    assert not [n for n in names if any(b in n for b in BANNED)], sorted(names)
    handle.disable()
    # Stock does show them (the check is meaningful).
    stock = build(mesh=mesh)
    train(stock, data[:1])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(stock, data[1:2])
    names = {e.name for e in prof.events()}
    assert [n for n in names if "chunk_cat" in n] and [n for n in names if "split_with_sizes" in n]

    # (e) gradient accumulation without sync, both modes.
    stock = build(mesh=mesh)
    train(stock, data, accumulate=2, set_sync=True)
    for mode in ("in_place", "slot_reuse"):
        model = build(mesh=mesh)
        handle = tide_torch.enable(model, mode=mode, topology=TOPO)
        train(model, data, accumulate=2, set_sync=True)
        assert_same(model, stock, f"accumulate {mode}")
        # fp32 gradients accumulated without sync reduce through the fp32-gradient plan.
        assert handle.stats["rs_stock"] == 0 and handle.stats["rs_tide"] > 0, handle.stats
        handle.disable()

    # (e) reshard_after_forward False / int / last block not resharding (ring-tail folding).
    for raf, kw, modes in ((False, {}, ("in_place",)), (2, {}, ("slot_reuse",)),
                           (True, {"last_no_reshard": True}, ("in_place", "slot_reuse"))):
        stock = build(mesh=mesh, reshard_after_forward=raf, **kw)
        train(stock, data)
        for mode in modes:
            model = build(mesh=mesh, reshard_after_forward=raf, **kw)
            handle = tide_torch.enable(model, mode=mode, topology=TOPO)
            train(model, data)
            assert_same(model, stock, f"raf={raf} {kw} {mode}")
            slots = {k: g["slot"] for k, g in handle.memory()["groups"].items()}
            if raf is False:  # all fixed but the folded ring tail
                assert slots == {"<root>": "fixed", "layers.0": "fixed", "layers.1": "fixed",
                                 "layers.2": "ring0"}, slots
            if kw:
                assert handle.memory()["groups"]["layers.2"]["slot"] == "ring0"
            for name, (planned, got) in handle.landings().items():
                assert got == planned, (raf, mode, name)
            handle.disable()


def test_profiler_accumulation_reshard():
    spawn(_profile_and_variants)


def _has_param_groups_per_module() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    return hasattr(_fsdp_common, "ShardPlacementResult")


def _param_groups_per_module(rank, world):
    """FSDP2 2.12+ splits one module's parameters into several param groups when they shard over
    different process groups (e.g. experts on a sub-mesh). Each is a TIDE group; siblings unshard
    together, so they get fixed storage, not ring slots; training matches stock bitwise."""
    import tide_torch
    from _torch_dist import DIM, HIDDEN
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                   ShardPlacementResult)
    from torch.distributed.tensor import Shard

    mesh = mesh_1d()
    sub = FSDPMeshInfo(init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))["shard"],
                       shard_mesh_dim=0)  # ranks {0, 1} and {2, 3}: one node each on TOPO

    def placement(p):  # w1 and w3 of block 0 shard over the sub-mesh
        return ShardPlacementResult(Shard(0), sub) if tuple(p.shape) == (HIDDEN, DIM) else None

    model = build(mesh=mesh, shard_placement_fn=placement)
    stock = build(mesh=mesh, shard_placement_fn=placement)
    handle = tide_torch.enable(model, topology=TOPO)
    siblings = [g for g in handle.groups if g.siblings == 2]
    assert len(siblings) == 2, [(g.fqn, g.siblings) for g in handle.groups]
    assert sorted(g.world for g in siblings) == [2, 4], [(g.fqn, g.world) for g in siblings]
    assert all(g.eligible and g.slot == "fixed" for g in siblings), \
        [(g.fqn, g.fallback, g.slot) for g in siblings]
    assert siblings[1].fqn == siblings[0].fqn[:-1] + "1"
    data = batches(3, same_on_all_ranks=True)
    assert train(model, data) == train(stock, data)
    assert handle.stats["ag_stock"] == 0 and handle.stats["rs_stock"] == 0, handle.stats
    assert_same(model, stock, "param groups per module")
    handle.disable()


def test_param_groups_per_module():
    import pytest
    if not _has_param_groups_per_module():
        pytest.skip("this torch's FSDP2 has one param group per module (several since 2.12)")
    spawn(_param_groups_per_module)
