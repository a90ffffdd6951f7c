"""tide_torch under FSDP2 schedules that stress the 2-slot ring (world 4, 2 nodes x 2), each
bitwise against stock FSDP2 on exact data:

- activation checkpointing (forward recomputed inside backward);
- no-grad evaluation between training steps with the last block not resharding (the folded ring
  tail is resharded before its slot is reused);
- gradient accumulation without resharding after backward: set before enable() (those groups get
  fixed storage; Slot-Reuse then reads gradients in place), and toggled per micro-step with
  enable(ring=False); toggled with the ring on, the groups that stop resharding after backward
  move to their own storage at their next forward all-gather (no error, nothing corrupted),
  where their all-gathers still land through TIDE (a cast: they pull).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

import tide
from _torch_dist import assert_same, batches, build, mesh_1d, spawn, train

TOPO = tide.Topology(nodes=2, gpus_per_node=2)


def _checkpointed(model):
    for layer in model.layers:
        fwd = layer.forward
        layer.forward = lambda x, fwd=fwd: checkpoint(fwd, x, use_reentrant=False)
    return model


def _evaluate(model, data):
    with torch.no_grad():
        for tokens in data:
            model(tokens[:, :-1])


def _no_reshard_after_backward(model):
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_backward(False, recurse=False)
    return model


def _schedules(rank, world):
    import tide_torch
    mesh = mesh_1d()
    data = batches(4, same_on_all_ranks=True)

    # Activation checkpointing.
    stock = _checkpointed(build(mesh=mesh))
    train(stock, data[:2])
    for mode in ("in_place", "slot_reuse"):
        model = _checkpointed(build(mesh=mesh))
        handle = tide_torch.enable(model, mode=mode, topology=TOPO)
        train(model, data[:2])
        assert_same(model, stock, f"checkpointing {mode}")
        handle.disable()

    # No-grad evaluation between steps, last block not resharding after forward.
    def run(m):
        train(m, data[:1])
        _evaluate(m, data[1:3])
        train(m, data[3:])
    stock = build(mesh=mesh, last_no_reshard=True)
    run(stock)
    model = build(mesh=mesh, last_no_reshard=True)
    handle = tide_torch.enable(model, topology=TOPO)
    run(model)
    assert_same(model, stock, "evaluation")
    handle.disable()

    # Accumulation without resharding after backward, set before enable(): fixed storage.
    stock = _no_reshard_after_backward(build(mesh=mesh))
    train(stock, data, accumulate=2, set_sync=True)
    model = _no_reshard_after_backward(build(mesh=mesh))
    handle = tide_torch.enable(model, mode="slot_reuse", topology=TOPO)
    assert {g["slot"] for g in handle.memory()["groups"].values()} == {"fixed"}
    train(model, data, accumulate=2, set_sync=True)
    assert_same(model, stock, "no reshard after backward")
    assert handle.stats["rs_tide"] > 0 and handle.stats["rs_stock"] == 0, handle.stats
    handle.disable()

    # Toggled per micro-step (reshard only after the last one): ring=False.
    stock = build(mesh=mesh)
    _train_toggling(stock, data)
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, topology=TOPO, ring=False)
    _train_toggling(model, data)
    assert_same(model, stock, "toggled reshard after backward")
    handle.disable()
    # ... and with the ring on, the overlap is detected, never silently landed nor raised: the
    # group that finds its slot taken moves to its own storage (placement.py [Note: ring depth]).
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, topology=TOPO)
    _train_toggling(model, data)
    assert_same(model, stock, "toggled reshard after backward, ring on")
    assert any(g.moved for g in handle.groups), handle.groups
    assert not handle.hand_backs, handle.hand_backs  # the moved groups' all-gathers pull
    assert handle.stats["ag_own_storage"] > 0 and handle.stats["ag_tide"] > 0, handle.stats
    handle.disable()


def _train_toggling(model, data):
    from torch.distributed.fsdp import FSDPModule
    import torch.nn.functional as F
    from _torch_dist import VOCAB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for step in range(2):
        for micro in range(2):
            last = micro == 1
            for m in mods:
                m.set_requires_gradient_sync(last, recurse=False)
                m.set_reshard_after_backward(last, recurse=False)
            tokens = data[2 * step + micro]
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def test_schedules():
    spawn(_schedules)
