"""Helpers for tide_torch's multi-process CPU tests: a tiny Llama, FSDP2 set-up, a spawner.

Ranks are processes (torch.multiprocessing, forkserver by default; TIDE_TEST_START=fork|spawn)
on a gloo process group initialised from a file, so concurrent test runs never fight over ports.
World 4 by default.
"""
from __future__ import annotations

import math
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 37      # dim 0 not divisible by the world size
DIM = 16
N_HEADS = 4
N_KV = 2        # GQA
HIDDEN = 24


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # 1-D

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        hd = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * hd, bias=False)
        self.wk = nn.Linear(DIM, N_KV * hd, bias=False)
        self.wv = nn.Linear(DIM, N_KV * hd, bias=False)
        self.wo = nn.Linear(N_HEADS * hd, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        hd = DIM // N_HEADS
        q = self.wq(x).view(b, t, N_HEADS, hd).transpose(1, 2)
        k = self.wk(x).view(b, t, N_KV, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, N_KV, hd).transpose(1, 2)
        rep = N_HEADS // N_KV
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        att = F.softmax(att.float() + mask, dim=-1).type_as(q)
        y = (att @ v).transpose(1, 2).reshape(b, t, N_HEADS * hd)
        return self.wo(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class TinyLlama(nn.Module):
    def __init__(self, n_layers: int = 3):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def mesh_1d(device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (dist.get_world_size(),))


def build(seed: int = 0, *, n_layers: int = 3, mesh=None, reshard_after_forward: Any = True,
          mp_policy=None, shard_placement_fn=None, last_no_reshard: bool = False,
          dtype=torch.float32, device=None) -> nn.Module:
    """``device``: where the model lives (default CPU); initial values are drawn on CPU, so
    they are the same on every device."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(seed)
    model = TinyLlama(n_layers).to(dtype)
    if device is not None:
        model = model.to(device)
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        raf = reshard_after_forward
        if last_no_reshard and i == n_layers - 1:
            raf = False
        fully_shard(layer, mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy,
                    shard_placement_fn=shard_placement_fn if i == 0 else None)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def batches(n: int, *, same_on_all_ranks: bool, seed: int = 1, batch: int = 2, seq: int = 8):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + (0 if same_on_all_ranks else 1000 * rank))
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=g) for _ in range(n)]


def train(model: nn.Module, data: list, *, accumulate: int = 1, lr: float = 1e-2,
          set_sync: bool = False, loss_scale: float = 1.0, device=None,
          optimizer: str = "adamw") -> list[float]:
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    else:  # linear in the gradients: no sign amplification when comparing devices
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(len(data) // accumulate):
        for micro in range(accumulate):
            tokens = data[step * accumulate + micro]
            if device is not None:
                tokens = tokens.to(device)
            if set_sync:
                model.set_requires_gradient_sync(micro == accumulate - 1)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameter shards, on CPU."""
    return {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}


def reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


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
        dist.destroy_process_group()


def _start_method() -> str:
    """forkserver by default: ranks fork from a clean server that preloaded torch once per
    session (fast, and no fork of a process whose thread pools earlier tests may have used)."""
    method = os.environ.get("TIDE_TEST_START", "forkserver")
    if method == "forkserver":
        import multiprocessing
        multiprocessing.set_forkserver_preload(
            ["torch", "torch.distributed.fsdp", "tide", "tide_torch", "_torch_dist"])
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
