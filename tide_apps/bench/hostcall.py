"""Host time per call of tide_torch's CUDA path beside stock FSDP2's: ``tide bench hostcall``.

One rank per process on the local GPUs (several processes share one GPU when there are fewer),
each with the arena on the CUDA-IPC fabric and the transport ``tide_torch.enable()`` would pick
(``CudaExecutorTransport``); the group is a model's layer group (default Llama-3.1-70B's block:
bf16 all-gather and gradients, fp32 master shards). Every rank calls the transport's
``all_gather`` and ``reduce_scatter`` as FSDP2's hooks do; the figure is the host wall clock of
each call (enqueue only: the GPU work is waited for outside the timed span, and the ranks meet on
a gloo barrier before each call). The first call, which builds and registers the programs, is
reported apart.

``--graphs`` (the default on CUDA) adds TIDE's replayed column: the same calls on a transport whose
executor replays repeated calls as CUDA graphs (``tide.ExecutorOptions(graphs=True)``, exec/cuda/
graph.h [Note: replayed calls]), on a fresh arena after the eager column's. A call is replayed
when its buffer pointers repeat; the inputs here are allocated once, as a training step's are
when the caching allocator hands the same addresses back, so every call after the second (the
first runs eager, the second is captured) should be a replay: the table says how many were (the
rank executor's graph_launches) and the column's figures leave out each rank's first two calls.

Stock FSDP2's column comes from the same processes, group and ranks, first (its buffers are freed
before TIDE's arena is made): a ``fully_shard``'ed module of the group's shapes whose own
collective functions are timed the same way (hostcall_stock.py says which calls and how), over
NCCL (ranks sharing a GPU are emulated hosts to NCCL, as ``tide bench train --shared-gpu`` runs
them). The table prints both medians and p90s and TIDE's median over stock's.

``--device cpu`` (gloo, the CPU executor on shared-memory arenas) runs the same two columns on a
machine without a GPU, with ``--scale`` to shrink the group: a smoke run for tests, not a figure.

    python -m tide_apps.bench.hostcall --ranks 8 [--model llama3.1-70b] [--iters 30] [--no-graphs] [--json PATH]
    python -m tide_apps.bench.hostcall --device cpu --ranks 2 --scale 64 --iters 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time


def _signature(args):
    """The group's signature; ``--scale K`` divides every dimension by K (rounded up)."""
    import tide
    from tide import models
    sig = models.signature(args.model, args.group, shard_dtype="float32")
    if args.scale == 1:
        return sig
    shapes = tuple(tuple(max(1, -(-d // args.scale)) for d in s) for s in sig.shapes)
    return tide.GroupSignature(shapes=shapes, names=sig.names, shard_dtype="float32")


def _stats(per_rank: list[list[float]], skip: int = 1) -> dict:
    """Median and p90 of every rank's calls after its first `skip` (microseconds), the slowest first
    call."""
    steady = sorted(t for r in per_rank for t in r[skip:])
    return {"median_us": statistics.median(steady) * 1e6,
            "p90_us": steady[int(0.9 * (len(steady) - 1))] * 1e6,
            "first_call_ms": max(r[0] for r in per_rank) * 1e3}


def _tide(rank, world, device, sig, args, sync, barrier, graphs: bool = False) -> dict:
    """TIDE's column: this rank's transport calls, seconds each ("ag", "rs"), and its executor's
    graph counts ("graph_captures", "graph_launches": None where the executor has none).
    `graphs`: the executor replays repeated calls as CUDA graphs."""
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    import tide
    from tide_torch import comm, placement
    from tide_torch.arena import Arena
    from tide_torch.groups import Chunk, TideGroup

    topo = tide.Topology(nodes=1, gpus_per_node=world)
    plan = tide.plan(sig, topo, mode=args.mode)
    shapes = [tuple(s) for s in sig.shapes]
    n = len(shapes)
    tg = TideGroup(index=0, fqn=f"{args.model}:{args.group}", is_root=False, world=world,
                   topology=topo,
                   pg=SimpleNamespace(post_forward_mesh_info=object(),
                                      reshard_after_backward=True),
                   ag_dtypes=[torch.bfloat16] * n, shard_dtypes=[torch.float32] * n, shapes=shapes)
    tg.set_chunks([Chunk(0, tuple(range(n)), plan, torch.bfloat16, torch.float32)])
    cuda = device.type == "cuda"
    arena = Arena(placement.assign([tg]), device, rank=rank, world=world, fabric=cuda)
    transport = None
    try:
        placement.bind([tg], arena)
        handles: list = [None] * world
        dist.all_gather_object(handles, arena.ipc_handle() if cuda else arena.shm_name)
        arena.open_peers(handles)
        options = tide.ExecutorOptions(graphs=True) if graphs else None
        transport = comm.make_transport(arena, [None] * world if cuda else handles, rank, topo,
                                        group_of=None, options=options)
        layout = plan.layout
        shards = [torch.randn(pl.e, device=device) for pl in layout.params]
        grads = [torch.randn(s, device=device).to(torch.bfloat16) for s in shapes]
        out = torch.zeros(layout.E, device=device)
        times: dict = {"ag": [], "rs": []}
        for _ in range(args.iters + 1):
            for what in ("ag", "rs"):
                sync()
                barrier()
                t0 = time.perf_counter()
                if what == "ag":
                    transport.all_gather(tg, shards, tg.landing_views)
                else:
                    transport.reduce_scatter(tg, plan, "rs", grads, out, 1.0 / world)
                times[what].append(time.perf_counter() - t0)
        if cuda:
            transport.synchronize()
        barrier()
        ex = getattr(transport, "_exec", None)
        for k in ("graph_captures", "graph_launches"):
            times[k] = getattr(ex, k, None)
        return times
    finally:
        if transport is not None:
            transport.close()
        arena.close()


def _rank(rank: int, world: int, init: str, args, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from tide_apps import llama_spec
    from tide_apps.bench import hostcall_stock

    cuda = args.device == "cuda"
    if cuda:
        ngpu = torch.cuda.device_count()
        if world > ngpu:  # before NCCL starts: ranks sharing a GPU are emulated hosts to NCCL
            os.environ.update(llama_spec.emulated_host_env(rank))
        device = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(device)
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    else:
        ngpu = 0
        torch.set_num_threads(1)
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        sig = _signature(args)
        stock_group = dist.new_group(backend="nccl") if cuda else dist.group.WORLD
        stock = hostcall_stock.measure([tuple(s) for s in sig.shapes], device, stock_group,
                                       args.stock_iters, sync, dist.barrier)
        if cuda:
            torch.cuda.empty_cache()
        times = _tide(rank, world, device, sig, args, sync, dist.barrier)
        replayed = None
        if args.graphs:  # a fresh arena and executor: counters start over
            if cuda:
                torch.cuda.empty_cache()
            replayed = _tide(rank, world, device, sig, args, sync, dist.barrier, graphs=True)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"tide": times, "stock": stock, "graphs": replayed})
        if rank == 0:
            res = {"model": args.model, "group": args.group, "scale": args.scale, "ranks": world,
                   "gpus": ngpu, "mode": args.mode, "iters": args.iters,
                   "stock_iters": args.stock_iters,
                   "transport": "tide-cuda-executor" if cuda else "tide-executor",
                   "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                   "elements": sum(math.prod(s) for s in sig.shapes),
                   "stock_grad_dtype": stock["grad_dtype"], "graphs": bool(args.graphs)}
            for what in ("ag", "rs"):
                res[what] = _stats([g["tide"][what] for g in gathered])
                res["stock_" + what] = _stats([g["stock"][what] for g in gathered])
                res[what]["ratio_to_stock"] = res[what]["median_us"] / res["stock_" + what]["median_us"]
                if args.graphs:  # each rank's first call is eager, its second captured
                    r = res["graphs_" + what] = _stats([g["graphs"][what] for g in gathered], skip=2)
                    r["ratio_to_stock"] = r["median_us"] / res["stock_" + what]["median_us"]
                    r["ratio_to_eager"] = r["median_us"] / res[what]["median_us"]
            if args.graphs:
                res["graph_calls_per_rank"] = 2 * (args.iters + 1)  # AG and RS calls
                for k in ("graph_captures", "graph_launches"):
                    res[k] = [g["graphs"][k] for g in gathered]
            with open(out_path, "w") as f:
                json.dump(res, f)
    finally:
        # Stock's fully_shard'ed module and mesh sit in reference cycles that hold the gloo
        # process group: collected now, its worker threads are joined here and not during
        # interpreter shutdown, where one dropping a tensor's Python object aborts the process.
        import gc
        gc.collect()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tide bench hostcall", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="processes (ranks of one node)")
    ap.add_argument("--model", default="llama3.1-70b")
    ap.add_argument("--group", default="block")
    ap.add_argument("--scale", type=int, default=1,
                    help="divide every dimension of the group's shapes by this (small runs, CPU)")
    ap.add_argument("--mode", default="in_place", choices=("in_place", "slot_reuse"))
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                    help="cuda: the CUDA executor and NCCL (default when there is a GPU); cpu: "
                         "the CPU executor and gloo (a smoke run: not a host-time figure)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per collective")
    ap.add_argument("--stock-iters", type=int, default=10,
                    help="timed calls per collective of stock FSDP2 (each one waits for its "
                         "collective: on emulated hosts NCCL's sockets carry the whole group)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="also time TIDE with its calls replayed as CUDA graphs "
                         "(ExecutorOptions(graphs=True)), beside the eager column (default: on "
                         "with --device cuda, off on cpu, whose executor has no graphs)")
    ap.add_argument("--json", default=None, help="write the result to this path")
    args = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tide bench hostcall: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.graphs is None:
        args.graphs = args.device == "cuda"
    if args.ranks < 2 or min(args.iters, args.stock_iters, args.scale) < 1:
        ap.error("--ranks must be >= 2, --iters, --stock-iters and --scale >= 1")
    if args.graphs and args.iters < 2:
        ap.error("--graphs needs --iters >= 2 (a rank's first call runs eager, its second is captured)")
    fd, init = tempfile.mkstemp(prefix="tide_hostcall_pg_")
    os.close(fd)
    os.unlink(init)
    fd, out_path = tempfile.mkstemp(prefix="tide_hostcall_", suffix=".json")
    os.close(fd)
    try:
        mp.start_processes(_rank, args=(args.ranks, f"file://{init}", args, out_path),
                           nprocs=args.ranks, join=True, start_method="spawn")
        with open(out_path) as f:
            res = json.load(f)
    finally:
        for p in (init, out_path):
            if os.path.exists(p):
                os.unlink(p)
    scale = f" / {res['scale']}" if res["scale"] != 1 else ""
    print(f"# host time per call, TIDE (tide_torch's transport) beside stock FSDP2 (its own "
          f"foreach_all_gather + copy-out, foreach_reduce): {res['model']} {res['group']}{scale} "
          f"({res['elements']} elements), {res['ranks']} ranks on {res['gpus']} GPU(s) "
          f"({res['device']}), {res['mode']}, transport {res['transport']}, torch {res['torch']}, "
          f"{res['iters']} calls per rank (stock {res['stock_iters']}); stock's unsharded gradients {res['stock_grad_dtype']}, "
          "TIDE's bfloat16")
    if not res["graphs"]:
        print(f"{'call':5s} {'TIDE med us':>12s} {'TIDE p90 us':>12s} {'stock med us':>13s} "
              f"{'stock p90 us':>13s} {'TIDE/stock':>11s} {'first call ms':>14s}")
        for what in ("ag", "rs"):
            r, st = res[what], res["stock_" + what]
            print(f"{what:5s} {r['median_us']:12.1f} {r['p90_us']:12.1f} {st['median_us']:13.1f} "
                  f"{st['p90_us']:13.1f} {r['ratio_to_stock']:10.2f}x {r['first_call_ms']:14.1f}")
    else:
        print(f"{'call':5s} {'eager med us':>12s} {'eager p90 us':>12s} {'graph med us':>12s} "
              f"{'graph p90 us':>12s} {'stock med us':>13s} {'stock p90 us':>13s} "
              f"{'eager/stock':>11s} {'graph/stock':>11s} {'first call ms':>14s}")
        for what in ("ag", "rs"):
            r, g, st = res[what], res["graphs_" + what], res["stock_" + what]
            print(f"{what:5s} {r['median_us']:12.1f} {r['p90_us']:12.1f} {g['median_us']:12.1f} "
                  f"{g['p90_us']:12.1f} {st['median_us']:13.1f} {st['p90_us']:13.1f} "
                  f"{r['ratio_to_stock']:10.2f}x {g['ratio_to_stock']:10.2f}x "
                  f"{r['first_call_ms']:14.1f}")
        launches, captures = res["graph_launches"], res["graph_captures"]
        if any(v is None for v in launches + captures):
            print("# graph column: this executor has no CUDA graphs (every call ran eager)")
        else:
            print(f"# graph column: {min(launches)}-{max(launches)} of {res['graph_calls_per_rank']} "
                  f"calls per rank launched as graphs ({min(captures)}-{max(captures)} captures); "
                  "figures leave out each rank's first two calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
