"""tide_torch on world 4 (CPU, gloo ranks as processes) against stock FSDP2 on identical per-rank
data (exact gradient sums, so results must be bitwise equal):

(e) HSDP on a 2-D mesh, a Shard(1) group in the same model (served), and a state-dict round trip
    (deepcopy of get_model_state_dict, torch.save/load) with fp32 masters and with bf16
    parameters adopted into the arena (in-place shard adoption);
(3) reduce ops folded into alpha: a custom gradient divide factor (PREMUL_SUM, which gloo itself
    rejects) against stock on a loss scaled to give the same gradients, and force-sum.
"""
from __future__ import annotations

import copy
import io

import torch

import tide
from _torch_dist import assert_same, batches, build, local_shards, mesh_1d, spawn, train

TOPO = tide.Topology(nodes=2, gpus_per_node=2)


def _hsdp_shard1_state_dict(rank, world):
    import tide_torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    data = batches(4, same_on_all_ranks=True)

    # (e) HSDP on a 2-D mesh (replicate 2 x shard 2): each shard group is one node of 2.
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    stock = build(mesh=mesh2)
    train(stock, data)
    model = build(mesh=mesh2)
    handle = tide_torch.enable(model, topology=TOPO)
    assert not handle.fallbacks, handle.fallbacks
    assert all(p.world == 2 and p.nodes == 1 for p in handle.plans.values())
    train(model, data)
    assert_same(model, stock, "hsdp")
    handle.disable()

    # (e) a Shard(1) group in the same model, served (tide/plan.py [Note: Shard(k) as rows]).
    mesh = mesh_1d()

    def shard1(p):
        return Shard(1) if p.ndim == 2 else None
    stock = build(mesh=mesh, shard_placement_fn=shard1)
    train(stock, data)
    model = build(mesh=mesh, shard_placement_fn=shard1)
    handle = tide_torch.enable(model, topology=TOPO)
    assert not handle.fallbacks, handle.fallbacks
    train(model, data)
    assert handle.stats["ag_stock"] == handle.stats["rs_stock"] == 0, handle.stats
    assert_same(model, stock, "shard1")
    handle.disable()

    # (e) state-dict round trip: deepcopy, save/load, restore; bf16 adopted groups too.
    for dtype in (torch.float32, torch.bfloat16):
        mp_policy = None
        if dtype == torch.bfloat16:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        model = build(mesh=mesh, dtype=dtype, mp_policy=mp_policy)
        handle = tide_torch.enable(model, mode="slot_reuse", topology=TOPO)
        if dtype == torch.bfloat16:  # in-place shard adoption: shards live in the arena
            assert handle.memory()["regions"]["resident"] > 0
        train(model, data[:2])
        saved = copy.deepcopy(get_model_state_dict(model))
        buf = io.BytesIO()
        torch.save(get_model_state_dict(model), buf)
        snapshot = local_shards(model)
        train(model, data[2:])
        assert any(not torch.equal(a, local_shards(model)[n]) for n, a in snapshot.items())
        set_model_state_dict(model, saved)
        for name, t in local_shards(model).items():
            assert torch.equal(t, snapshot[name]), ("deepcopy restore", name)
        train(model, data[2:3])
        buf.seek(0)
        set_model_state_dict(model, torch.load(buf, weights_only=False))
        for name, t in local_shards(model).items():
            assert torch.equal(t, snapshot[name]), ("torch.load restore", name)
        for name, (planned, got) in handle.landings().items():
            assert got == planned, ("after load", name)
        handle.disable()
        train(model, data[:1])  # stock again after disable


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _divide_factors_and_bf16(rank, world):
    import tide_torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mesh = mesh_1d()
    data = batches(3, same_on_all_ranks=True)

    # Custom divide factor 8 on world 4: FSDP2 asks for PREMUL_SUM(1/8), TIDE folds alpha = 1/8.
    # Stock (gloo has no PREMUL_SUM) gets the same gradients from AVG of a loss scaled by 1/2.
    stock = build(mesh=mesh)
    train(stock, data, loss_scale=0.5)
    model = build(mesh=mesh)
    for m in _fsdp_modules(model):  # not recursive in FSDP2
        m.set_gradient_divide_factor(8.0)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data)
    assert handle.stats["rs_tide"] > 0 and handle.stats["rs_stock"] == 0, handle.stats
    assert_same(model, stock, "divide factor 8")
    handle.disable()

    # Force-sum: SUM in the collective (alpha = 1), FSDP2's own post-division afterwards.
    stock = build(mesh=mesh)
    for m in _fsdp_modules(stock):
        m.set_force_sum_reduction_for_comms(True)
    train(stock, data)
    model = build(mesh=mesh)
    for m in _fsdp_modules(model):
        m.set_force_sum_reduction_for_comms(True)
    handle = tide_torch.enable(model, mode="slot_reuse", topology=TOPO)
    train(model, data)
    assert_same(model, stock, "force sum")
    handle.disable()

    # bf16 parameters (fp32 reduce): shards adopted into the arena, bitwise equal to stock.
    mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    stock = build(mesh=mesh, dtype=torch.bfloat16, mp_policy=mp_policy)
    train(stock, data)
    model = build(mesh=mesh, dtype=torch.bfloat16, mp_policy=mp_policy)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data)
    assert_same(model, stock, "bf16 adopted")
    # Later all-gathers read the adopted shards in place: the sharded parameters' local tensors
    # live in the arena's resident region.
    base, res = handle.memory()["regions"], handle._rt.arena.region("resident")
    for p in model.parameters():
        ptr = p.to_local().data_ptr() - handle._rt.arena.base_ptr
        assert res.offset <= ptr < res.offset + res.nbytes, (ptr, base)
    handle.disable()


def test_divide_factors_and_bf16_adoption():
    spawn(_divide_factors_and_bf16)


def test_hsdp_shard1_fallback_state_dict():
    spawn(_hsdp_shard1_state_dict)
