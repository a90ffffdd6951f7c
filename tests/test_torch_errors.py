"""(f) tide_torch.enable() failure modes: clear errors on every rank, never a hang.

- enable() before fully_shard;
- an unsupported torch (a patched FSDP2 function with another signature);
- ranks with different models, a different mode on one rank, a local failure on one rank
  (planning, or mapping the peers' arenas): every rank raises, naming the differing
  ranks/groups, and nothing stays patched;
- ``fabric``: a bad value (argument or TIDE_TORCH_FABRIC), the NCCL fabric on CPU; and, with the
  fabric's constructor recorded, how enable() builds it (rank 0's unique id on every rank, the
  largest arena size, after the verdict; a failure there raises on every rank).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import tide
from _torch_dist import TinyLlama, assert_same, batches, build, mesh_1d, spawn, train

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

    # A bad argument on one rank only: it is checked inside the agreement, so that rank raises
    # its own error and every other rank learns it in the same exchange (no rank waits, nothing is
    # mis-paired with a later call); no shared-memory segment of this enable() stays behind.
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("tide")}
    exc = ValueError if rank == 1 else tide_torch.TideAgreementError
    _expect(exc, ["mode"] if rank == 1 else ["rank 1 failed", "mode"],
            lambda: tide_torch.enable(model, mode="fast" if rank == 1 else "in_place", topology=TOPO))
    exc = TypeError if rank == 2 else tide_torch.TideAgreementError
    _expect(exc, ["bogus"] if rank == 2 else ["rank 2 failed", "bogus"],
            lambda: tide_torch.enable(model, topology=TOPO, **({"bogus": 1} if rank == 2 else {})))
    assert not _patches.installed()
    dist.barrier()
    assert {n for n in os.listdir("/dev/shm") if n.startswith("tide")} <= shm_before

    # Bad arguments on every rank.
    _expect(ValueError, ["mode"], lambda: tide_torch.enable(model, mode="fast"))
    _expect(TypeError, ["bogus"], lambda: tide_torch.enable(model, bogus=1))
    _expect(ValueError, ["fabric must be one of", "'pcie'"],
            lambda: tide_torch.enable(model, fabric="pcie"))
    os.environ["TIDE_TORCH_FABRIC"] = "pcie"
    try:
        _expect(ValueError, ["TIDE_TORCH_FABRIC", "'pcie'"], lambda: tide_torch.enable(model))
        # An explicit fabric does not read the variable.
        assert tide_torch.enable(model, fabric="ipc", topology=TOPO).disable() is None
    finally:
        del os.environ["TIDE_TORCH_FABRIC"]
    assert not _patches.installed()

    # The NCCL fabric on a CPU model: every rank raises, naming the device (argument or env).
    for kw, env in (({"fabric": "nccl"}, None), ({}, "nccl")):
        if env:
            os.environ["TIDE_TORCH_FABRIC"] = env
        try:
            _expect(tide_torch.TideEnableError, ["fabric='nccl'", "on cpu", "needs CUDA"],
                    lambda: tide_torch.enable(model, topology=TOPO, **kw))
        finally:
            os.environ.pop("TIDE_TORCH_FABRIC", None)
        assert not _patches.installed()

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


# Planner options with a bad value or type (issue 45): each used to let every group fall back
# to stock FSDP2 silently (a warning, handle.stats all zero); ring="no" was taken as True. The
# first block is the list, the second other values and options of the same kinds.
BAD_OPTIONS = [
    ({"k": -1}, tide.PlanError, "Options.k: must be in [0, 32]"),
    ({"n_stg": "2"}, tide.PlanError, "Options.n_stg: '2' is not an integer"),
    ({"n_stg": 2.5}, tide.PlanError, "Options.n_stg: 2.5 is not an integer"),
    ({"chunk_bytes": -4}, tide.PlanError, "Options.chunk_bytes: must be 0 (planner) or >= 2"),
    ({"w_wave": 99}, tide.PlanError, "Options.w_wave: W_wave = 99 exceeds L = 2"),
    ({"n_part": True}, tide.PlanError, "Options.n_part: True is a bool, not an integer"),
    ({"ring": "no"}, TypeError, "ring must be a bool, got 'no'"),
    ({"land_ctas": 5000}, tide.PlanError, "Options.land_ctas: must be in [0, 4096]"),
    ({"sum_ctas": "8"}, tide.PlanError, "Options.sum_ctas: '8' is not an integer"),
    ({"k": 1.0}, tide.PlanError, "Options.k: 1.0 is not an integer"),
    ({"n_stg": 0}, tide.PlanError, "Options.n_stg: must be in [1, 16], got 0"),
    ({"n_part": 17}, tide.PlanError, "Options.n_part: must be in [0, 16]"),
    ({"w_wave": -1}, tide.PlanError, "Options.w_wave: must be in [0, L=2]"),
    ({"chunk_bytes": None}, tide.PlanError, "Options.chunk_bytes: None is not an integer"),
    ({"k": 2**40}, tide.PlanError, "Options.k: 1099511627776 does not fit in 32 bits"),
    ({"ring": 1}, TypeError, "ring must be a bool, got 1"),
    ({"ring": None}, TypeError, "ring must be a bool, got None"),
]


def _bad_options(rank, world):
    import tide_torch
    from tide_torch import _patches

    model = build(mesh=mesh_1d(), n_layers=1)
    for kw, exc, fragment in BAD_OPTIONS:
        # On every rank: each raises the error itself, at enable(), nothing patched.
        _expect(exc, [fragment], lambda: tide_torch.enable(model, topology=TOPO, **kw))
        assert not _patches.installed(), kw
        # On rank 1 only: it raises its error, the others learn it in the agreement.
        _expect(exc if rank == 1 else tide_torch.TideAgreementError,
                [fragment] if rank == 1 else ["rank 1 failed", fragment],
                lambda: tide_torch.enable(model, topology=TOPO, **(kw if rank == 1 else {})))
        assert not _patches.installed(), kw
    # Good values of the same options are served by TIDE (no fallback), numpy ints included.
    import numpy as np
    handle = tide_torch.enable(model, topology=TOPO, k=np.int64(1), n_stg=3, w_wave=2,
                               chunk_bytes=0, n_part=2, ring=False)
    assert not handle.fallbacks and handle.plans, handle.fallbacks
    train(model, batches(1, same_on_all_ranks=True))
    assert handle.stats["ag_tide"] > 0 and handle.stats["rs_tide"] > 0, handle.stats
    handle.disable()


def test_enable_refuses_bad_option_values_and_types_on_every_rank():
    spawn(_bad_options)


def _hidden(rank, world, module, name):
    """Runs in a fresh (spawned) process: hides one FSDP2 piece before tide_torch is imported,
    as a torch that lacks it would."""
    import importlib

    import torch
    owner = importlib.import_module(f"torch.distributed.fsdp._fully_shard.{module}")
    cls, _, attr = name.rpartition(".")
    if cls:
        owner = getattr(owner, cls)
    delattr(owner, attr)
    assert getattr(owner, attr, None) is None

    import tide_torch  # must still import
    from tide_torch import _patches
    from tide_torch.groups import find_groups
    problems = _patches.check_torch()
    assert any(f"{module}.{name} is missing" in p for p in problems), problems
    model = build(mesh=mesh_1d(), n_layers=1)
    _expect(tide_torch.TideTorchVersionError,
            [f"{module}.{name} is missing", torch.__version__], lambda: tide_torch.enable(model))
    assert not _patches.installed()
    assert all(not getattr(fp, "__dict__", {}).get("free_unsharded_param")
               for g in find_groups(model) for fp in g.pg.fsdp_params)  # no instance patched


@pytest.mark.parametrize("module,name", [
    ("_fsdp_collectives", "foreach_reduce_scatter_copy_in"),
    ("_fsdp_param_group", "foreach_all_gather"),
    ("_fsdp_param", "FSDPParam.init_all_gather_outputs"),
    ("_fsdp_collectives", "AllGatherResult"),
])
def test_missing_fsdp2_piece_is_named_at_enable(module, name):
    """A torch whose FSDP2 lacks a function or class TIDE patches or builds on: import works,
    enable() raises TideTorchVersionError naming it, and nothing is patched."""
    spawn(_hidden, module, name, world=1, start_method="spawn")


def _copy_out_route(rank, world):
    """The all-gather copy-out goes through FSDP2's per-group seam where it has one
    (FSDPParamGroup._all_gather_output_fn) and through the module-level patch otherwise; disable()
    restores whichever it changed. Training stays bitwise equal to stock either way."""
    import inspect

    import tide_torch
    from tide_torch import _patches
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg_mod

    stock_copy_out = pg_mod.foreach_all_gather_copy_out
    seam = "all_gather_output_fn" in inspect.signature(stock_copy_out).parameters
    assert _patches.copy_out_seam() == seam
    mesh = mesh_1d()
    model, stock = build(mesh=mesh), build(mesh=mesh)
    handle = tide_torch.enable(model, topology=TOPO)
    for g in handle.groups:
        fn = getattr(g.pg, "_all_gather_output_fn", None)
        if seam:
            assert fn is not None and fn is not _patches.default_copy_out(), g.fqn
        else:
            assert fn is None, g.fqn
    if seam:
        assert pg_mod.foreach_all_gather_copy_out is stock_copy_out
    else:
        assert getattr(pg_mod.foreach_all_gather_copy_out, "_tide_hook", False)
    data = batches(3, same_on_all_ranks=True)
    assert train(model, data) == train(stock, data)
    assert handle.stats["ag_tide"] > 0 and handle.stats["ag_stock"] == 0, handle.stats
    assert_same(model, stock, "copy-out route")
    handle.disable()
    assert pg_mod.foreach_all_gather_copy_out is stock_copy_out
    for g in handle.groups:
        fn = getattr(g.pg, "_all_gather_output_fn", None)
        assert fn is (_patches.default_copy_out() if seam else None), g.fqn


def test_copy_out_route_per_torch():
    spawn(_copy_out_route)


def test_supported_torch_and_imports():
    from tide_torch import _patches
    assert _patches.check_torch() == []
    code = ("import sys; sys.modules['jax'] = None; import tide_torch; "
            "assert 'jax' not in [m for m in sys.modules if sys.modules[m] is not None]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


class _RecordedNcclFabric:
    """Stands in for tide._core.cuda.NcclFabric in _nccl_flow: records its arguments and close()."""

    def __init__(self, calls, rank, world, device, nbytes, unique_id, gpus_per_node):
        calls.append((rank, world, nbytes, unique_id, gpus_per_node))
        self.arena_bytes, self.calls = nbytes, calls

    def close(self):
        self.calls.append("close")


def _nccl_flow(rank, world):
    """enable(fabric="nccl") on CPU ranks standing in for CUDA ones, with the fabric recorded:
    every rank constructs it after the verdict with rank 0's unique id and the largest arena size
    (rank 1 claims 4096 bytes more here), gpus_per_node from the topology; when a rank fails
    there, every rank raises and closes the fabric (collectively) only if every rank built one."""
    import importlib

    import tide_torch
    from tide_torch import _patches
    en = importlib.import_module("tide_torch.enable")
    topo = tide.Topology(nodes=1, gpus_per_node=2)
    model = build(mesh=mesh_1d())
    en._check_nccl_fabric = lambda device, transport: None
    tide._core.cuda.nccl_unique_id = lambda: bytes([rank + 1]) * 128  # only rank 0's may be used
    tide._core.cuda.nccl_version = lambda: 22809
    real_nbytes = en.arena_nbytes
    sizes = []
    en.arena_nbytes = lambda s: sizes.append(real_nbytes(s)) or sizes[-1] + 4096 * rank
    calls = []

    def fails(*args):
        _RecordedNcclFabric(calls, *args)
        raise RuntimeError(f"NcclFabric refused on rank {rank}")
    en.make_nccl_fabric = fails
    _expect(RuntimeError, [f"NcclFabric refused on rank {rank}"],
            lambda: tide_torch.enable(model, fabric="nccl", topology=topo))
    assert not _patches.installed()
    assert calls == [(rank, world, sizes[0] + 4096, bytes([1]) * 128, 2)], calls  # no close

    # Every rank builds it, then rank 1 fails (its arena view; rank 0 gets a plain arena and a
    # stand-in transport): rank 1 raises its error, rank 0 names rank 1, both close the fabric.
    calls.clear()
    en.make_nccl_fabric = lambda *args: _RecordedNcclFabric(calls, *args)
    real_arena = en.Arena

    def arena(sizes, device, *, nccl, nbytes):
        assert nbytes == nccl.arena_bytes == sizes_bytes + 4096, (nbytes, nccl.arena_bytes)
        if rank == 1:
            raise RuntimeError("arena view refused")
        return real_arena(sizes, device, nbytes=nbytes)
    sizes_bytes = sizes[0]
    en.Arena = arena
    en.comm.make_transport = lambda *args, **kw: "stand-in"
    exc = RuntimeError if rank == 1 else tide_torch.TideAgreementError
    _expect(exc, ["arena view refused"] + (["rank 1"] if rank == 0 else []),
            lambda: tide_torch.enable(model, fabric="nccl", topology=topo))
    assert not _patches.installed()
    assert calls[1:] == ["close"], calls


def test_nccl_fabric_flow_recorded():
    spawn(_nccl_flow, world=2)
