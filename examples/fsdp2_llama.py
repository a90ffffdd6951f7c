"""Train a Llama-style model with FSDP2: stock, TIDE In-Place and TIDE Slot-Reuse; print step
time, peak memory, loss and FSDP2's layout copies for each.

    # one GPU (world 1), or every GPU of the node with torchrun (NCCL)
    .venv/bin/python examples/fsdp2_llama.py --size small --json out.json
    torchrun --nproc-per-node 2 examples/fsdp2_llama.py --size 1b

    # one GPU shared by 4 ranks, each an emulated host (NCCL over loopback), 2 nodes x 2
    .venv/bin/python examples/fsdp2_llama.py --world 4 --shared-gpu --nodes 2 --size tiny

    # CPU: 4 gloo ranks as processes on this machine, emulating 2 nodes x 2
    .venv/bin/python examples/fsdp2_llama.py --device cpu
    .venv/bin/python examples/fsdp2_llama.py --device cpu --world 4 --nodes 2 --steps 10 --variants stock,tide_slot_reuse

The model and its training loop are tide_apps/llama.py's (the demo's and the tests' too; here
with PyTorch's fused attention). Its sizes, initial weights, tokens and AdamW hyperparameters
come from tide_apps/llama_spec.py, shared with examples/flax_fsdp.py (the same model in JAX):
every run starts from the same numpy weights (--seed) with MixedPrecisionPolicy(bf16, fp32),
rank r trains on rows [r B, (r + 1) B) of the same global batches (B = --batch), and the loss
printed is the mean over every rank's tokens. Step time is the median over the steps after
``--warmup`` (each step ends with torch.cuda.synchronize), the profiled step left out. Peak memory is
torch.cuda.max_memory_allocated (reset between runs, counted above what the run found allocated,
so that an earlier variant's leftovers do not count) plus, for TIDE, the arena: on the CUDA-IPC
fabric it is a cudaMalloc outside torch's allocator and holds the unsharded parameters that
stock FSDP2 allocates through it. On CPU the table shows the process's peak RSS (not reset
between runs) and the JSON has null. Layout copies: FSDP2's all-gather copy-in, copy-out
(split_with_sizes_copy) and reduce-scatter pack (_chunk_cat), calls and bytes written in one
step on rank 0, counted by torch.profiler (step 1; step 0 builds the unsharded parameters).
``--json PATH`` (rank 0) writes {"framework", "device", "world", "model" (llama_spec.describe),
"runs": [{"name", "step_ms",
"peak_bytes", "final_loss", "losses", "layout_copies": {op: {"calls", "bytes"}},
"copies_source"}]}.
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
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

# A checkout whose core is built in place (make build) runs from the checkout; otherwise the
# installed packages (pip install .) are used.
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if glob.glob(os.path.join(_ROOT, "tide", "_core*.so")):
    sys.path.insert(0, _ROOT)

from tide_apps import llama  # noqa: E402 - the checkout's, when its core is built in place
from tide_apps import llama_spec as common  # noqa: E402

# stock_again: stock FSDP2 a second time, the same settings: how far stock is from itself (a
# nondeterministic kernel shows here, not as a TIDE difference).
VARIANTS = {"stock": None, "tide_in_place": "in_place", "tide_slot_reuse": "slot_reuse",
            "tide_in_place_graphs": "in_place", "stock_again": None}
DEFAULT_VARIANTS = ("stock", "tide_in_place", "tide_slot_reuse")
# CUDA: calls replayed as CUDA graphs (tide.ExecutorOptions(graphs=True); exec/cuda/graph.h).
GRAPHS = {"tide_in_place_graphs"}
PROFILE_STEP = 1  # step 0 builds the unsharded parameters: the layout copies of a later one


def Llama(vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int) -> nn.Module:
    """The example's Llama: tide_apps.llama's model with PyTorch's fused attention (SDPA)."""
    return llama.Llama(vocab, dim, layers, heads, kv_heads, hidden, attention="sdpa",
                       eps=common.RMS_EPS)


def load_weights(model: nn.Module, args) -> None:
    """Fills `model` (parameters still unsharded) with llama_spec's numpy weights, checking
    that its parameters are the shared specification's, name by name and shape by shape."""
    params = dict(model.named_parameters())
    specs = common.param_specs(args)
    if [(n, tuple(p.shape)) for n, p in params.items()] != [(n, s) for n, s, _ in specs]:
        raise RuntimeError("the torch Llama's parameters differ from llama_spec.param_specs")
    with torch.no_grad():
        for name, w in common.init_weights(args, args.seed):
            params[name].copy_(torch.from_numpy(w))


def run(args, device: torch.device, variant: str) -> tuple[dict, dict]:
    import tide
    import tide_torch
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device.type == "cuda"
    # What an earlier variant left allocated in this process is not this run's: peaks are counted
    # above it (on the 1b model about one fp32 copy of the parameters outlives `del model`).
    # cuBLAS's workspaces are freed first, so that every run allocates its own (64 MiB on an H200)
    # and the first variant is not the only one to pay for them.
    if cuda and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()
    base = torch.cuda.memory_allocated(device) if cuda else 0
    with torch.device("meta"):
        model = Llama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.hidden)
    model.to_empty(device=device)
    load_weights(model, args)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    llama.fully_shard_llama(model, mesh)  # MixedPrecisionPolicy(bf16, fp32)
    handle = None
    if VARIANTS[variant] is not None:
        topo = None
        if args.nodes:
            world = dist.get_world_size()
            topo = tide.Topology(nodes=args.nodes, gpus_per_node=world // args.nodes)
        handle = tide_torch.enable(model, mode=VARIANTS[variant], topology=topo,
                                   transport=args.transport, fabric=args.fabric,
                                   serve_single_rank=args.serve_single_rank,
                                   executor_options=tide.ExecutorOptions(graphs=variant in GRAPHS))
    hp = common.ADAMW
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                            weight_decay=hp["weight_decay"])
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    data = [torch.from_numpy(b[rows]).long().to(device)
            for b in common.token_batches(args, args.steps, args.batch * world, args.seed)]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    phases = {}  # --phases: the largest peak of each step phase over the steps (CUDA)

    def phase(name):
        if cuda and args.phases:
            torch.cuda.synchronize(device)
            phases[name] = max(phases.get(name, 0), torch.cuda.max_memory_allocated(device) - base)
            torch.cuda.reset_peak_memory_stats(device)

    profile_step = min(PROFILE_STEP, args.steps - 1)
    trace_step = args.steps - 1 if args.trace else None
    breakdown = {}

    def on_trace(prof):  # this rank's Chrome trace of the step, and where its milliseconds went
        from tide_apps.bench import timeline
        path = os.path.join(args.trace, f"{variant}.rank{rank}.json")
        prof.export_chrome_trace(path)
        breakdown.update(timeline.breakdown_file(path), trace=path)

    done = llama.train(model, data, opt, device=device, phase=phase, mean_over_ranks=True,
                       profile_step=profile_step if rank == 0 else None, trace_step=trace_step,
                       on_trace=on_trace)
    times, losses, copies = done.times, done.losses, done.copies
    arena = handle.memory()["arena_bytes"] if handle else 0
    if cuda:
        peak = max([torch.cuda.max_memory_allocated(device) - base] + list(phases.values()))
        if handle is not None and handle.transport == "tide-cuda-executor":
            peak += arena  # the fabric's cudaMalloc / ncclMemAlloc, outside torch's allocator
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    timed = [t for i, t in enumerate(times[args.warmup:], args.warmup) if i not in (PROFILE_STEP, trace_step)]
    stats = {"name": variant, "step_ms": statistics.median(timed or times[-1:]) * 1e3,
             "peak_bytes": int(peak), "final_loss": losses[-1], "losses": losses,
             "layout_copies": copies,
             "copies_source": f"torch.profiler, rank 0, step {profile_step}",
             "breakdown": breakdown or None,
             # printed, not in the JSON:
             "arena_bytes": arena, "transport": handle.transport if handle else "stock",
             "fallbacks": handle.fallbacks if handle else {}, "phases": phases,
             "served": f"{len(handle.plans)}/{len(handle.groups)}" if handle else "-",
             "tide_stats": handle.stats if handle else {}}
    shards = {n: p.to_local().detach().float().cpu() for n, p in model.named_parameters()}
    if handle is not None:
        handle.disable()
    del model, opt, handle, data
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return stats, shards


JSON_KEYS = ("name", "step_ms", "peak_bytes", "final_loss", "losses", "layout_copies",
             "copies_source", "breakdowns")


def main_worker(rank: int, world: int, init: str, args) -> None:
    # torch.profiler (the layout copies): no "gpuGetDeviceCount failed" lines on CPU hosts, no
    # warning that a profile without a schedule keeps one cycle (it is one step).
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    warnings.filterwarnings("ignore", message=".*Profiler clears events")
    if args.device == "cuda" and args.shared_gpu:  # before NCCL starts: this rank is a host of its own
        os.environ.update(common.emulated_host_env(rank))
    if args.device == "cuda":
        local = 0 if args.shared_gpu else int(os.environ.get("LOCAL_RANK", rank))
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
        for s in results:  # every rank's breakdown of the traced step, gathered on every rank
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, s.pop("breakdown"))
            s["breakdowns"] = got if any(got) else None
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
                if s["tide_stats"]:
                    print(f"  {s['name']} calls: " + ", ".join(f"{k} {v}" for k, v in s["tide_stats"].items()))
                if s["layout_copies"] is not None:
                    print(f"  {s['name']} FSDP2 layout copies ({s['copies_source']}): " + ", ".join(
                        f"{op} {c['calls']} ({c['bytes']:,} B)"
                        for op, c in s["layout_copies"].items()))
            if args.trace:
                from tide_apps.bench import timeline
                print(f"where the traced step's milliseconds go (step {args.steps - 1}, ms; traces in "
                      f"{args.trace}). CUDA: once a variant's step was traced, CUPTI stays attached to "
                      "the process and slows every later launch: take step times from a run without "
                      "--trace")
                for r in range(dist.get_world_size()):
                    cols = {s["name"]: s["breakdowns"][r] for s in results
                            if s["breakdowns"] and s["breakdowns"][r]}
                    print(f"  rank {r}")
                    for line in timeline.table(cols):
                        print("    " + line)
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
                               "model": common.describe(args, dist.get_world_size()),
                               "runs": [{k: s[k] if k != "peak_bytes" or device.type == "cuda"
                                         else None for k in JSON_KEYS} for s in results]},
                              f, indent=1)
                print(f"wrote {args.json}")
    finally:
        # The models are garbage by now, in reference cycles that still hold the process group:
        # collected first, the group is really torn down here (its gloo worker threads joined),
        # not during interpreter exit, where a worker dropping a collective's last tensor
        # reference needs the GIL that finalization no longer gives (SIGABRT).
        gc.collect()
        dist.destroy_process_group()


def main() -> None:
    intro, usage = __doc__.split("\n\nThe model")[0].split("\n\n", 1)  # whole paragraphs
    ap = argparse.ArgumentParser(description=intro, epilog="examples:\n" + usage,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"),
                    help="cuda: NCCL, one GPU per rank (default when torch sees a GPU); cpu: gloo")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks to spawn without torchrun (CPU default 4, CUDA default 1)")
    ap.add_argument("--nodes", type=int, default=0,
                    help="emulated nodes (0: LOCAL_WORLD_SIZE; with --shared-gpu: one per rank)")
    ap.add_argument("--shared-gpu", action="store_true",
                    help="CUDA: the --world ranks share GPU 0, each an emulated host (its own NCCL_HOSTID, "
                         "NCCL over loopback sockets): correctness and overheads, not bandwidth")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)} (default "
                         f"{','.join(DEFAULT_VARIANTS)}; tide_in_place_graphs: CUDA calls replayed as graphs)")
    ap.add_argument("--transport", default="auto", choices=("auto", "executor"),
                    help="tide_torch.enable(transport=...): auto (TIDE's executor for the model's "
                         "device, stock FSDP2 where it cannot run) or executor (raise instead)")
    ap.add_argument("--serve-single-rank", action="store_true",
                    help="world 1: run TIDE's path anyway (tide_torch.enable(serve_single_rank=True)); "
                         "without it a one-rank job keeps stock FSDP2")
    ap.add_argument("--fabric", default="auto", choices=("auto", "ipc", "nccl"),
                    help="the CUDA executor's fabric (tide_torch.enable(fabric=...))")
    common.add_args(ap)  # --size, --vocab ... --batch (per rank), --seq, --seed
    ap.add_argument("--steps", type=int, default=10, help="AdamW steps per variant (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--json", default=None, help="write the results (rank 0) to this path")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="profile the last step of every variant on every rank (CPU and CUDA "
                         "activities): DIR/<variant>.rank<r>.json Chrome traces and a breakdown "
                         "of where the step's time goes (tide_apps/bench/timeline.py); that step "
                         "is left out of the median")
    ap.add_argument("--phases", action="store_true",
                    help="CUDA: also print each step phase's peak (forward, backward, optimizer)")
    args = ap.parse_args()
    common.resolve(ap, args)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        ap.error(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    if args.warmup < 0 or args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    if args.trace:
        if args.steps - 1 <= max(PROFILE_STEP, args.warmup):
            ap.error(f"--trace profiles the last step: --steps {args.steps} leaves none after "
                     f"--warmup {args.warmup} and the layout-copy step {PROFILE_STEP} to time")
        os.makedirs(args.trace, exist_ok=True)
        args.trace = os.path.abspath(args.trace)
    if "RANK" in os.environ:  # torchrun
        main_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        return
    if args.world is None:
        args.world = 4 if args.device == "cpu" else 1
    if args.shared_gpu and (args.device != "cuda" or "RANK" in os.environ):
        ap.error("--shared-gpu: CUDA ranks this script spawns itself (not torchrun)")
    if args.shared_gpu and args.nodes == 0:
        args.nodes = args.world
    if args.device == "cuda" and args.world > torch.cuda.device_count() and not args.shared_gpu:
        ap.error(f"--world {args.world} needs one GPU per rank; {torch.cuda.device_count()} "
                 "visible (NCCL refuses two ranks on one GPU; --shared-gpu emulates one host per rank)")
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
