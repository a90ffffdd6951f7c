"""(f) tide_torch.enable() failure modes: clear errors on every rank, never a hang.

- enable() before fully_shard;
- an unsupported torch (a patched FSDP2 function with another signature);
- ranks with different models, a different mode on one rank, a local failure on one rank
  (planning, or mapping the peers' arenas): every rank raises, naming the differing
  ranks/groups, and nothing stays patched.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

import tide
from _torch_dist import TinyLlama, batches, build, mesh_1d, spawn, train

TOPO = tide.Topology(nodes=2, gpus_per_node=2)


def _expect(exc_type, fragments, fn):
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def _errors(rank, world):
    import tide_torch
    from tide_torch import _patches
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    # enable() before fully_shard.
    _expect(tide_torch.TideEnableError, ["fully_shard"],
            lambda: tide_torch.enable(TinyLlama(), topology=TOPO))

    mesh = mesh_1d()
    model = build(mesh=mesh)

    # Unsupported torch: a patched function whose signature differs.
    stock = coll.foreach_reduce_scatter_copy_in

    def other(unsharded_grads, reduce_scatter_input, world_size, extra=None):
        return stock(unsharded_grads, reduce_scatter_input, world_size)
    coll.foreach_reduce_scatter_copy_in = other
    try:
        _expect(tide_torch.TideTorchVersionError, ["foreach_reduce_scatter_copy_in", "torch"],
                lambda: tide_torch.enable(model, topology=TOPO))
    finally:
        coll.foreach_reduce_scatter_copy_in = stock
    assert not _patches.installed()

    # Ranks with different models: rank 3 has one block fewer.
    other_model = build(mesh=mesh, n_layers=2 if rank == 3 else 3)
    _expect(tide_torch.TideAgreementError, ["rank 3", "FSDP groups"],
            lambda: tide_torch.enable(other_model, topology=TOPO))
    assert not _patches.installed()

    # A different mode on rank 1: same groups, different plan hashes.
    _expect(tide_torch.TideAgreementError, ["rank 1", "group 0"],
            lambda: tide_torch.enable(model, mode="slot_reuse" if rank == 1 else "in_place",
                                      topology=TOPO))

    # A local failure on rank 2 only (its topology does not match the world).
    bad = tide.Topology(nodes=1, gpus_per_node=2) if rank == 2 else TOPO
    exc = tide_torch.TideEnableError if rank == 2 else tide_torch.TideAgreementError
    _expect(exc, ["rank 2"] if rank != 2 else ["topology"],
            lambda: tide_torch.enable(model, topology=bad))
    assert not _patches.installed()

    # Mapping the peers' arenas fails on rank 3 only (after the plans agreed): every rank
    # raises, rank 3 its own error, and nothing stays patched.
    from tide_torch.arena import Arena
    open_peers = Arena.open_peers

    def failing_open_peers(self, handles):
        if rank == 3:
            raise RuntimeError("cannot open rank 0's arena")
        return open_peers(self, handles)
    Arena.open_peers = failing_open_peers
    try:
        exc = RuntimeError if rank == 3 else tide_torch.TideAgreementError
        _expect(exc, ["rank 0's arena"] if rank == 3 else ["rank 3", "map the peers' arenas"],
                lambda: tide_torch.enable(model, topology=TOPO))
    finally:
        Arena.open_peers = open_peers
    assert not _patches.installed()

    # Bad arguments are caught before any collective.
    _expect(ValueError, ["mode"], lambda: tide_torch.enable(model, mode="fast"))
    _expect(TypeError, ["bogus"], lambda: tide_torch.enable(model, bogus=1))

    # Everyone is still in lock-step, and the model still trains: stock first (its unsharded
    # parameters get stock storage), then TIDE enabled between steps (rebuilt over landings).
    dist.barrier()
    data = batches(2, same_on_all_ranks=True)
    train(model, data[:1])
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data[1:])
    for name, (planned, got) in handle.landings().items():
        assert got == planned, name
    handle.disable()
    assert not _patches.installed()
    train(model, data[:1])


def test_enable_errors_no_hang():
    spawn(_errors)


def test_supported_torch_and_imports():
    from tide_torch import _patches
    assert _patches.check_torch() == []
    code = ("import sys; sys.modules['jax'] = None; import tide_torch; "
            "assert 'jax' not in [m for m in sys.modules if sys.modules[m] is not None]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
