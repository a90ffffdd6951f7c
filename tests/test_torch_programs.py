"""tide_torch driving TIDE's own all-gather and reduce-scatter programs (tide.VirtualCluster, the
CPU executor) inside FSDP2 training: same checks as test_torch_parity.py — bitwise equal to stock
FSDP2 on exact data, within fp32 tolerance on random data, landings at planned addresses — with
TIDE's landing layout, fp32 summation order and alpha folding producing the bytes.
"""
from __future__ import annotations

import tide
from _torch_dist import assert_same, batches, build, mesh_1d, spawn, train
from test_torch_parity import parity

CASES = ((True, "in_place"), (False, "slot_reuse"))


def _programs_2x2(rank, world):
    import tide_torch
    parity(rank, world, 2, 2, "virtual-cluster", CASES)
    # Accumulation without sync: the sync step reduces fp32 gradients (fp32-gradient RS plan).
    mesh = mesh_1d()
    data = batches(4, same_on_all_ranks=True)
    stock = build(mesh=mesh)
    train(stock, data, accumulate=2, set_sync=True)
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, topology=tide.Topology(2, 2), transport="virtual-cluster")
    train(model, data, accumulate=2, set_sync=True)
    assert handle.stats["rs_stock"] == 0, handle.stats
    assert_same(model, stock, "accumulate, TIDE programs")
    handle.disable()


def test_programs_2x2():
    spawn(_programs_2x2)


def test_programs_4x1():
    spawn(parity, 4, 1, "virtual-cluster", CASES)
