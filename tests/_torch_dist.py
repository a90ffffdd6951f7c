"""Helpers for tide_torch's multi-process CPU tests: a tiny Llama, FSDP2 set-up, a spawner.

The model, its FSDP2 wrapping and the training loop are tide_apps/llama.py's (the demo's and the
example's too); this file picks the tests' sizes and keeps their call signatures.

Ranks are processes (torch.multiprocessing, forkserver by default; TIDE_TEST_START=fork|spawn)
on a gloo process group initialised from a file, so concurrent test runs never fight over ports.
World 4 by default.
"""
from __future__ import annotations

import gc
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from tide_apps.llama import Llama, fully_shard_llama, local_shards, reshard
from tide_apps.llama import train as llama_train

VOCAB = 37      # dim 0 not divisible by the world size
DIM = 16
N_HEADS = 4
N_KV = 2        # GQA
HIDDEN = 24


def TinyLlama(n_layers: int = 3, norm: str = "explicit") -> nn.Module:
    """The tests' Llama: tide_apps.llama's model at these sizes, explicit-softmax attention;
    ``norm="torch"``: torch's nn.RMSNorm."""
    return Llama(VOCAB, DIM, n_layers, N_HEADS, N_KV, HIDDEN, attention="explicit", norm=norm)


def mesh_1d(device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (dist.get_world_size(),))


def build(seed: int = 0, *, n_layers: int = 3, mesh=None, reshard_after_forward: Any = True,
          mp_policy=None, shard_placement_fn=None, last_no_reshard: bool = False,
          dtype=torch.float32, device=None, norm: str = "explicit") -> nn.Module:
    """``device``: where the model lives (default CPU); initial values are drawn on CPU, so
    they are the same on every device. ``norm``: TinyLlama's."""
    torch.manual_seed(seed)
    model = TinyLlama(n_layers, norm).to(dtype)
    if device is not None:
        model = model.to(device)
    return fully_shard_llama(model, mesh, mp_policy=mp_policy,
                             reshard_after_forward=reshard_after_forward,
                             last_no_reshard=last_no_reshard,
                             shard_placement_fn=shard_placement_fn)


def batches(n: int, *, same_on_all_ranks: bool, seed: int = 1, batch: int = 2, seq: int = 8):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + (0 if same_on_all_ranks else 1000 * rank))
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=g) for _ in range(n)]


def train(model: nn.Module, data: list, *, accumulate: int = 1, lr: float = 1e-2,
          set_sync: bool = False, loss_scale: float = 1.0, device=None,
          optimizer: str = "adamw") -> list[float]:
    """tide_apps.llama.train with AdamW (weight decay 0.1) or SGD; the loss of every batch."""
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    else:  # linear in the gradients: no sign amplification when comparing devices
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    return llama_train(model, data, opt, accumulate=accumulate, set_sync=set_sync,
                       loss_scale=loss_scale, device=device).losses


def assert_same(model: nn.Module, stock: nn.Module, what: str) -> None:
    """Bitwise equality of this rank's parameter shards."""
    reshard(model)
    reshard(stock)
    got, ref = local_shards(model), local_shards(stock)
    for name, t in ref.items():
        assert torch.equal(got[name], t), (what, name, (got[name] - t).abs().max())


def _entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple,
           backend: str = "gloo", cuda_devices: tuple[int, ...] | None = None,
           env: dict[str, str] | None = None) -> None:
    for k, v in (env or {}).items():  # per rank ("{rank}" substituted), before any NCCL init
        os.environ[k] = v.format(rank=rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    kwargs = {}
    if cuda_devices is not None:
        torch.cuda.set_device(cuda_devices[rank])
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", cuda_devices[rank])
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, **kwargs)
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        # The models' reference cycles hold the group: collected first, it is torn down here,
        # not during interpreter exit (examples/fsdp2_llama.py says why that aborts).
        gc.collect()
        dist.destroy_process_group()


def _start_method() -> str:
    """forkserver by default: ranks fork from a clean server that preloaded torch once per
    session (fast, and no fork of a process whose thread pools earlier tests may have used)."""
    method = os.environ.get("TIDE_TEST_START", "forkserver")
    if method == "forkserver":
        import multiprocessing
        multiprocessing.set_forkserver_preload(
            ["torch", "torch.distributed.fsdp", "tide", "tide_torch", "tide_apps.llama",
             "_torch_dist"])
    return method


def spawn(fn: Callable, *args: Any, world: int = 4, backend: str = "gloo",
          cuda_devices: tuple[int, ...] | None = None, start_method: str | None = None,
          env: dict[str, str] | None = None) -> None:
    """Runs fn(rank, world, *args) on ``world`` ranks (gloo by default); re-raises the first
    failure. ``cuda_devices[r]``: rank r's GPU (set before the process group starts); ``env``:
    variables each rank sets first ("{rank}" in a value is its rank, e.g. NCCL_HOSTID)."""
    fd, init_file = tempfile.mkstemp(prefix="tide_torch_pg_")
    os.close(fd)
    os.unlink(init_file)
    try:
        mp.start_processes(_entry, args=(world, init_file, fn, args, backend, cuda_devices, env),
                           nprocs=world, join=True,
                           start_method=start_method or _start_method())
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
