"""Train a Llama-style model with FSDP2: stock, TIDE In-Place and TIDE Slot-Reuse; print step
time, peak memory and loss for each.

    # one GPU (world 1), or every GPU of the node with torchrun (NCCL)
    python examples/fsdp2_llama.py --size small --json out.json
    torchrun --nproc-per-node 2 examples/fsdp2_llama.py --size 1b

    # CPU: 4 gloo ranks as processes on this machine, emulating 2 nodes x 2
    python examples/fsdp2_llama.py --device cpu
    python examples/fsdp2_llama.py --device cpu --world 4 --nodes 2 --steps 10 --variants stock,tide_slot_reuse

Every run uses the same seed, data and MixedPrecisionPolicy(bf16, fp32). Step time is the median
over the steps after ``--warmup`` (each step ends with torch.cuda.synchronize). Peak memory is
torch.cuda.max_memory_allocated (reset between runs, counted above what the run found allocated,
so that an earlier variant's leftovers do not count) plus, for TIDE, the arena: on the CUDA-IPC
fabric it is a cudaMalloc outside torch's allocator and holds the unsharded parameters that
stock FSDP2 allocates through it. On CPU the table shows the process's peak RSS (not reset
between runs) and the JSON has null.
``--json PATH`` (rank 0) writes {"framework", "device", "world", "runs": [{"name", "step_ms",
"peak_bytes", "final_loss", "losses"}]}.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# A checkout whose core is built in place (make build) runs from the checkout; otherwise the
# installed packages (pip install .) are used.
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if glob.glob(os.path.join(_ROOT, "tide", "_core*.so")):
    sys.path.insert(0, _ROOT)

VARIANTS = {"stock": None, "tide_in_place": "in_place", "tide_slot_reuse": "slot_reuse"}
# vocab, dim, layers, heads, kv_heads, hidden, batch, seq
SIZES = {
    "tiny": dict(vocab=503, dim=64, layers=4, heads=8, kv_heads=2, hidden=172, batch=4, seq=32),
    "small": dict(vocab=32000, dim=1024, layers=8, heads=16, kv_heads=4, hidden=2816, batch=4,
                  seq=1024),
    "1b": dict(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192, batch=4,
               seq=2048),  # Llama-3.2-1B's shapes
}


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
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.attention_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        n = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def run(args, device: torch.device, variant: str) -> tuple[dict, dict]:
    import tide
    import tide_torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda"
    # What an earlier variant left allocated in this process is not this run's: peaks are counted
    # above it (on the 1b model about one fp32 copy of the parameters outlives `del model`).
    base = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(0)
    model = Llama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads,
                  args.hidden).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    handle = None
    if VARIANTS[variant] is not None:
        topo = None
        if args.nodes:
            world = dist.get_world_size()
            topo = tide.Topology(nodes=args.nodes, gpus_per_node=world // args.nodes)
        handle = tide_torch.enable(model, mode=VARIANTS[variant], topology=topo,
                                   transport=args.transport, fabric=args.fabric,
                                   serve_single_rank=args.serve_single_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
            for _ in range(args.steps)]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    phases = {}  # --phases: the largest peak of each step phase over the steps (CUDA)

    def phase(name):
        if cuda and args.phases:
            torch.cuda.synchronize(device)
            phases[name] = max(phases.get(name, 0), torch.cuda.max_memory_allocated(device) - base)
            torch.cuda.reset_peak_memory_stats(device)

    for tokens in data:
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        del logits
        phase("forward")
        loss.backward()
        phase("backward")
        opt.step()
        opt.zero_grad()
        phase("optimizer")
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    arena = handle.memory()["arena_bytes"] if handle else 0
    if cuda:
        peak = max([torch.cuda.max_memory_allocated(device) - base] + list(phases.values()))
        if handle is not None and handle.transport == "tide-cuda-executor":
            peak += arena  # the fabric's cudaMalloc / ncclMemAlloc, outside torch's allocator
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    timed = times[args.warmup:] or times[-1:]
    stats = {"name": variant, "step_ms": statistics.median(timed) * 1e3, "peak_bytes": int(peak),
             "final_loss": losses[-1], "losses": losses,
             # printed, not in the JSON:
             "arena_bytes": arena, "transport": handle.transport if handle else "stock",
             "fallbacks": handle.fallbacks if handle else {}, "phases": phases,
             "served": f"{len(handle.plans)}/{len(handle.groups)}" if handle else "-"}
    shards = {n: p.to_local().detach().float().cpu() for n, p in model.named_parameters()}
    if handle is not None:
        handle.disable()
    del model, opt, handle, data
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return stats, shards


JSON_KEYS = ("name", "step_ms", "peak_bytes", "final_loss", "losses")


def main_worker(rank: int, world: int, init: str, args) -> None:
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        results, shards = [], {}
        for variant in args.variants:
            stats, shards[variant] = run(args, device, variant)
            results.append(stats)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print(f"{name}, world {dist.get_world_size()}, size {args.size}, {args.steps} steps "
                  f"(median after {args.warmup} warm-up)")
            for s in results:
                print(f"{s['name']:16s} step {s['step_ms']:9.2f} ms  peak "
                      f"{s['peak_bytes'] / 2**20:9.1f} MiB  loss {s['final_loss']:.5f}  "
                      f"arena {s['arena_bytes'] / 2**20:8.2f} MiB  groups {s['served']}  "
                      f"[{s['transport']}]")
                if s["phases"]:
                    print(f"  {s['name']} peak by phase (torch's allocator, MiB): " + ", ".join(
                        f"{k} {v / 2**20:.1f}" for k, v in s["phases"].items()))
                if s["fallbacks"]:
                    print(f"  {s['name']} stock fallbacks: {s['fallbacks']}")
            if "stock" in shards:
                for v, sh in shards.items():
                    if v != "stock":
                        diff = max((shards["stock"][n] - sh[n]).abs().max().item() for n in sh)
                        same = all(torch.equal(shards["stock"][n], sh[n]) for n in sh)
                        print(f"max |param(stock) - param({v})| after {args.steps} steps: "
                              f"{diff:.3e} (rank 0's shards bitwise equal: "
                              f"{'yes' if same else 'no'})")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"framework": "torch", "device": name,
                               "world": dist.get_world_size(),
                               "runs": [{k: s[k] if k != "peak_bytes" or device.type == "cuda"
                                         else None for k in JSON_KEYS} for s in results]},
                              f, indent=1)
                print(f"wrote {args.json}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks to spawn without torchrun (CPU default 4, CUDA default 1)")
    ap.add_argument("--nodes", type=int, default=0, help="emulated nodes (0: LOCAL_WORLD_SIZE)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--transport", default="auto",
                    choices=("auto", "executor"))
    ap.add_argument("--serve-single-rank", action="store_true",
                    help="world 1: run TIDE's path anyway (tide_torch.enable(serve_single_rank=True)); "
                         "without it a one-rank job keeps stock FSDP2")
    ap.add_argument("--fabric", default="auto", choices=("auto", "ipc", "nccl"),
                    help="the CUDA executor's fabric (tide_torch.enable(fabric=...))")
    ap.add_argument("--size", default="tiny", choices=tuple(SIZES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    for k in SIZES["tiny"]:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None,
                        help=f"override the size preset's {k}")
    ap.add_argument("--json", default=None, help="write the results (rank 0) to this path")
    ap.add_argument("--phases", action="store_true",
                    help="CUDA: also print each step phase's peak (forward, backward, optimizer)")
    args = ap.parse_args()
    for k, v in SIZES[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        ap.error(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    if args.dim % args.heads or args.heads % args.kv_heads:
        ap.error(f"--dim {args.dim} / --heads {args.heads} / --kv-heads {args.kv_heads}: heads "
                 "must divide dim and kv-heads must divide heads")
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    if "RANK" in os.environ:  # torchrun
        main_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        return
    if args.world is None:
        args.world = 4 if args.device == "cpu" else 1
    if args.device == "cuda" and args.world > torch.cuda.device_count():
        ap.error(f"--world {args.world} needs one GPU per rank; {torch.cuda.device_count()} "
                 "visible (NCCL refuses two ranks on one GPU)")
    if args.device == "cpu" and args.nodes == 0 and args.world % 2 == 0:
        args.nodes = 2
    fd, path = tempfile.mkstemp(prefix="tide_example_pg_")
    os.close(fd)
    os.unlink(path)
    try:
        if args.world == 1:
            main_worker(0, 1, f"file://{path}", args)
        else:
            import torch.multiprocessing as mp
            mp.start_processes(main_worker, args=(args.world, f"file://{path}", args),
                               nprocs=args.world, join=True, start_method="spawn")
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
