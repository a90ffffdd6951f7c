"""`tide demo`'s training section: a small Llama-style model trained with FSDP2 and
MixedPrecisionPolicy(bf16, fp32), stock and with ``tide_torch`` (In-Place and Slot-Reuse), on
the same data on every rank, so every gradient sum is exact and the runs must agree bit for bit.

CPU: 4 gloo ranks as processes, emulating 2 nodes x 2 GPUs (TIDE's programs run through the
per-rank process-mode executor). CUDA: one process per GPU over NCCL (world = number of GPUs),
or world 1 on one GPU. Rank 0 writes what it measured as JSON for the parent to print.

Imported by ``tide.demo`` when it trains (the torch face holds it, so ``tide`` never imports torch)
and by examples/fsdp2_llama.py (``layout_copies``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tide

RUNS = ("stock", "in_place", "slot_reuse")
# FSDP2's layout copies, as torch.profiler names them (the aten op inside each fsdp:: wrapper;
# all_gather_copy_in has no aten op of its own).
COPY_OPS = ("aten::split_with_sizes_copy", "aten::_chunk_cat", "fsdp::all_gather_copy_in")
_ELEM = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8}


@dataclass(frozen=True)
class Config:
    vocab: int = 503      # dim 0 not divisible by the world size: FSDP2 pads, TIDE's R_p too
    dim: int = 64
    layers: int = 3
    heads: int = 8
    kv_heads: int = 2     # GQA
    hidden: int = 172
    batch: int = 4
    seq: int = 32
    steps: int = 4
    lr: float = 1e-2
    profile_step: int = 1  # step 0 builds the unsharded parameters; profile a steady step


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


class Block(nn.Module):
    """A Llama decoder block: RMSNorm, GQA attention (explicit softmax: deterministic on CUDA
    too), RMSNorm, SwiGLU MLP."""

    def __init__(self, c: Config):
        super().__init__()
        self.heads, self.kv_heads, self.hd = c.heads, c.kv_heads, c.dim // c.heads
        self.attention_norm = RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.heads * self.hd, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(c.heads * self.hd, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        att = F.softmax(att.float() + mask, dim=-1).type_as(q)
        x = x + self.wo((att @ v).transpose(1, 2).reshape(b, t, -1))
        n = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Llama(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def layout_copies(prof, world: int) -> dict[str, dict[str, int]]:
    """Calls of FSDP2's layout copies in a profile, and the bytes each wrote."""
    out = {op: {"calls": 0, "bytes": 0} for op in COPY_OPS}
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name not in out:
            continue
        shapes, dtypes = e.shapes(), e.dtypes()
        if name == "aten::split_with_sizes_copy":   # all-gather output -> unsharded params
            i, frac = 0, 1
        elif name == "aten::_chunk_cat":            # gradients -> packed fp32 RS input (out=)
            i, frac = 3, 1
        else:                                       # this rank's shards -> its AG input slot
            i, frac = 1, world
        out[name]["calls"] += 1
        out[name]["bytes"] += math.prod(shapes[i]) * _ELEM.get(dtypes[i], 0) // frac
    return out


def compare_shards(ref: dict, got: dict) -> tuple[bool, float]:
    """(bitwise equal, max |difference|) of two runs' local parameter shards, by name."""
    if set(ref) != set(got):
        raise ValueError(f"demo training: parameter names differ: {sorted(set(ref) ^ set(got))}")
    same = all(torch.equal(got[n], t) for n, t in ref.items())
    diff = max((got[n].double() - t.double()).abs().max().item() for n, t in ref.items())
    return same, diff


def _train_one(name: str, cfg: Config, mesh, device, topo, data) -> dict:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    import tide_torch

    torch.manual_seed(0)
    model = Llama(cfg).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # One GPU is world 1, where enable() keeps stock FSDP2 by default: the demo shows TIDE's path
    # (bitwise against stock) there too.
    handle = None if name == "stock" else tide_torch.enable(model, mode=name, topology=topo,
                                                            serve_single_rank=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    losses, times, ops, calls = [], [], None, None
    for step, tokens in enumerate(data):
        profiling = step == cfg.profile_step
        before = handle.stats if handle is not None else None
        with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                     record_shapes=True) if profiling
              else contextlib.nullcontext()) as prof:
            t0 = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab),
                                   tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        if profiling:
            ops = layout_copies(prof, dist.get_world_size())
            if handle is not None:
                calls = {k: v - before[k] for k, v in handle.stats.items()}
    # Step time: neither the first step (builds the unsharded parameters) nor the profiled one.
    steady = [t for i, t in enumerate(times) if i not in (0, cfg.profile_step)] or times
    res = {"losses": losses, "step_ms": statistics.median(steady) * 1e3,
           "copy_ops": ops, "tide_calls": calls, "transport": "stock", "fallbacks": {},
           "memory": None}
    if handle is not None:
        res.update(transport=handle.transport, fallbacks=handle.fallbacks,
                   memory=handle.memory())
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    res["shards"] = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    if handle is not None:
        handle.disable()
    return res


def _worker(rank: int, world: int, init_file: str, device_kind: str, topo_mn: tuple[int, int],
            cfg_d: dict, out_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no "gpuGetDeviceCount failed" on CPU hosts
    os.environ["LOCAL_WORLD_SIZE"] = str(topo_mn[1])
    warnings.filterwarnings("ignore", message=".*Profiler clears events")
    if device_kind == "cuda":
        # Safety (ARCHITECTURE.md): no NVLS / multicast from this demo, whatever the shell says.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
        # Same kernels in every run (bitwise comparison); NaN-filling torch.empty would only
        # add time to both runs' steps.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        warnings.filterwarnings("ignore", message=".*deterministic")
    else:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        cfg = Config(**cfg_d)
        topo = tide.Topology(*topo_mn)
        mesh = init_device_mesh(device.type, (world,))
        # The same tokens on every rank: every cross-rank gradient sum is exact in any order.
        # One batch, every step, so the loss visibly falls in a few steps.
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
        data = [tokens] * cfg.steps
        runs = {name: _train_one(name, cfg, mesh, device, topo, data) for name in RUNS}
        ref = runs["stock"].pop("shards")
        verdict = {}
        for name in RUNS[1:]:
            same, diff = compare_shards(ref, runs[name].pop("shards"))
            verdict[name] = {"bitwise": same, "max_abs_diff": diff,
                             "losses_equal": runs[name]["losses"] == runs["stock"]["losses"]}
        every = [None] * world
        dist.all_gather_object(every, verdict)
        if rank == 0:
            agree = {name: {"bitwise": all(v[name]["bitwise"] for v in every),
                            "losses_equal": all(v[name]["losses_equal"] for v in every),
                            "max_abs_diff": max(v[name]["max_abs_diff"] for v in every)}
                     for name in RUNS[1:]}
            result = {"device": device.type, "device_name": _device_name(device), "world": world,
                      "topology": list(topo_mn), "config": asdict(cfg), "runs": runs,
                      "agreement": agree}
            with open(out_path, "w") as f:
                json.dump(result, f)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gpu_topology(n_gpus: int) -> tuple[int, int]:
    """One process per GPU: M x L with L <= 8 (whole nodes of 8 beyond one node), else 1 x 1."""
    if 1 <= n_gpus <= 8:
        return (1, n_gpus)
    if n_gpus % 8 == 0:
        return (n_gpus // 8, 8)
    return (1, 1)


def gpu_unavailable_reason() -> str | None:
    """Why the GPU path cannot run here (None when it can)."""
    from tide import _core
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if not _core.cuda.available():
        return "tide._core has no usable CUDA executor (built without CUDA, or no driver)"
    if not dist.is_nccl_available():
        return "this torch has no NCCL backend"
    return None


def run(device: str = "cpu", cfg: Config | None = None,
        topology: tuple[int, int] = (2, 2)) -> dict:
    """Trains on ``device`` ("cpu": gloo ranks on ``topology``; "cuda": one rank per GPU) and
    returns rank 0's JSON result."""
    import torch.multiprocessing as mp

    if device not in ("cpu", "cuda"):
        raise ValueError(f"demo training: device must be 'cpu' or 'cuda', got {device!r}")
    cfg = cfg or Config()
    if device == "cuda":
        topology = gpu_topology(torch.cuda.device_count())
    world = topology[0] * topology[1]
    if cfg.steps <= cfg.profile_step:
        raise ValueError(f"demo training: steps must be > profile_step ({cfg.profile_step}), "
                         f"got {cfg.steps}")
    import multiprocessing
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.fsdp", "tide",
                                            "tide_torch", "tide_torch.demo_train"])
    tmp = tempfile.mkdtemp(prefix="tide_demo_")
    init_file, out_path = os.path.join(tmp, "pg"), os.path.join(tmp, "result.json")
    try:
        mp.start_processes(_worker, args=(world, init_file, device, topology, asdict(cfg),
                                          out_path),
                           nprocs=world, join=True,
                           # CUDA ranks start from a fresh interpreter: nothing CUDA-initialised
                           # is ever forked. CPU ranks fork from a server that preloaded torch.
                           start_method="spawn" if device == "cuda" else "forkserver")
        with open(out_path) as f:
            return json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
