"""`tide demo`'s training section: a small Llama-style model trained with FSDP2 and
MixedPrecisionPolicy(bf16, fp32), stock and with ``tide_torch`` (In-Place and Slot-Reuse), on
the same data on every rank, so every gradient sum is exact and the runs must agree bit for bit.

CPU: 4 gloo ranks as processes, emulating 2 nodes x 2 GPUs (TIDE's programs run through the
per-rank process-mode executor). CUDA: one process per GPU over NCCL (world = number of GPUs),
or world 1 on one GPU. Rank 0 writes what it measured as JSON for the parent to print.

Imported by tide_apps/demo.py only when it trains (``tide demo --no-train`` needs no torch).
The model, its FSDP2 wrapping and the training loop are tide_apps/llama.py's.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import traceback
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import tide
from tide_apps import llama
from tide_apps.llama import COPY_OPS, compare_shards  # noqa: F401 - re-exported (the tests)

RUNS = ("stock", "in_place", "slot_reuse")


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


def model(c: Config) -> llama.Llama:
    """The demo's Llama (explicit-softmax attention: deterministic on CUDA too)."""
    return llama.Llama(c.vocab, c.dim, c.layers, c.heads, c.kv_heads, c.hidden,
                       attention="explicit")


def _train_one(name: str, cfg: Config, mesh, device, topo, data) -> dict:
    import tide_torch

    torch.manual_seed(0)
    net = llama.fully_shard_llama(model(cfg).to(device), mesh)
    # One GPU is world 1, where enable() keeps stock FSDP2 by default: the demo shows TIDE's path
    # (bitwise against stock) there too.
    handle = None if name == "stock" else tide_torch.enable(net, mode=name, topology=topo,
                                                            serve_single_rank=True)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=0.1)
    done = llama.train(net, data, opt, device=device, profile_step=cfg.profile_step,
                       counters=(lambda: handle.stats) if handle is not None else None)
    times = done.times
    # Step time: neither the first step (builds the unsharded parameters) nor the profiled one.
    steady = [t for i, t in enumerate(times) if i not in (0, cfg.profile_step)] or times
    res = {"losses": done.losses, "step_ms": statistics.median(steady) * 1e3,
           "copy_ops": done.copies, "tide_calls": done.counters, "transport": "stock",
           "fallbacks": {}, "memory": None}
    if handle is not None:
        res.update(transport=handle.transport, fallbacks=handle.fallbacks,
                   memory=handle.memory())
    llama.reshard(net)
    res["shards"] = llama.local_shards(net)
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
        # The models' reference cycles hold the group: collected first, it is torn down here,
        # not during interpreter exit (examples/fsdp2_llama.py says why that aborts).
        gc.collect()
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
                                            "tide_torch", "tide_apps.demo_train"])
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
