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
