"""Train a small Llama-style model with FSDP2, with and without TIDE; print step time, peak memory
and loss for both.

    # CPU (default): 4 gloo ranks as processes on this machine, emulating 2 nodes x 2
    python examples/fsdp2_llama.py
    python examples/fsdp2_llama.py --world 4 --nodes 2 --steps 10 --mode slot_reuse

    # CUDA, one process per GPU (NCCL)
    torchrun --nproc-per-node 2 examples/fsdp2_llama.py --device cuda

Both runs use the same seed, data and MixedPrecisionPolicy(bf16, fp32); the last line compares
the final parameters of the two runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


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


def run(args, device: torch.device, use_tide: bool):
    import tide
    import tide_torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Llama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads,
                  args.hidden).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    handle = None
    if use_tide:
        topo = None
        if args.nodes:
            world = dist.get_world_size()
            topo = tide.Topology(nodes=args.nodes, gpus_per_node=world // args.nodes)
        handle = tide_torch.enable(model, mode=args.mode, topology=topo, transport=args.transport)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
            for _ in range(args.steps)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for tokens in data:
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    warm = times[1:] or times
    stats = {"step_s": sorted(warm)[len(warm) // 2], "peak_bytes": peak, "loss": losses[-1],
             "arena_bytes": handle.memory()["arena_bytes"] if handle else 0,
             "transport": handle.transport if handle else "stock",
             "fallbacks": handle.fallbacks if handle else {}}
    shards = {n: p.to_local().detach().float().cpu() for n, p in model.named_parameters()}
    if handle is not None:
        handle.disable()
    return stats, shards


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
        stock, stock_shards = run(args, device, use_tide=False)
        tide_stats, tide_shards = run(args, device, use_tide=True)
        diff = max((stock_shards[n] - tide_shards[n]).abs().max().item() for n in stock_shards)
        if dist.get_rank() == 0:
            for name, s in (("stock FSDP2", stock), (f"TIDE ({args.mode})", tide_stats)):
                print(f"{name:18s} step {s['step_s'] * 1e3:8.2f} ms  peak "
                      f"{s['peak_bytes'] / 2**20:8.1f} MiB  loss {s['loss']:.5f}  "
                      f"arena {s['arena_bytes'] / 2**20:.2f} MiB  [{s['transport']}]")
            if tide_stats["fallbacks"]:
                print("stock fallbacks:", tide_stats["fallbacks"])
            print(f"max |param(stock) - param(TIDE)| after {args.steps} steps: {diff:.3e}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--world", type=int, default=4, help="CPU: ranks to spawn")
    ap.add_argument("--nodes", type=int, default=0, help="emulated nodes (0: LOCAL_WORLD_SIZE)")
    ap.add_argument("--mode", default="in_place", choices=("in_place", "slot_reuse"))
    ap.add_argument("--transport", default="auto",
                    choices=("auto", "executor", "virtual-cluster", "interim"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=503)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=172)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    assert args.dim % args.heads == 0 and args.heads % args.kv_heads == 0, "bad head config"
    if "RANK" in os.environ:  # torchrun
        main_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        return
    if args.device == "cpu" and args.nodes == 0 and args.world % 2 == 0:
        args.nodes = 2
    fd, path = tempfile.mkstemp(prefix="tide_example_pg_")
    os.close(fd)
    os.unlink(path)
    import torch.multiprocessing as mp
    try:
        mp.start_processes(main_worker, args=(args.world, f"file://{path}", args),
                           nprocs=args.world, join=True, start_method="spawn")
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
