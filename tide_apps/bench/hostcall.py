"""Host time per call of tide_torch's CUDA path: ``tide bench hostcall``.

One rank per process on the local GPUs (several processes share one GPU when there are fewer),
each with the arena on the CUDA-IPC fabric and the transport ``tide_torch.enable()`` would pick
(``CudaExecutorTransport``); the group is a model's layer group (default Llama-3.1-70B's block:
bf16 all-gather and gradients, fp32 master shards). Every rank calls the transport's
``all_gather`` and ``reduce_scatter`` as FSDP2's hooks do; the figure is the host wall clock of
each call (enqueue only: the GPU work is waited for outside the timed span, and the ranks meet on
a gloo barrier before each call). The first call, which builds and registers the programs, is
reported apart.

    python -m tide_apps.bench.hostcall --ranks 8 [--model llama3.1-70b] [--iters 30] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _rank(rank: int, world: int, init: str, args, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    import tide
    from tide import models
    from tide_torch import comm, placement
    from tide_torch.arena import Arena
    from tide_torch.groups import TideGroup

    ngpu = torch.cuda.device_count()
    device = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        topo = tide.Topology(nodes=1, gpus_per_node=world)
        sig = models.signature(args.model, args.group, shard_dtype="float32")
        plan = tide.plan(sig, topo, mode=args.mode)
        shapes = [tuple(s) for s in sig.shapes]
        tg = TideGroup(index=0, fqn=f"{args.model}:{args.group}", is_root=False, world=world,
                       topology=topo,
                       pg=SimpleNamespace(post_forward_mesh_info=object(),
                                          reshard_after_backward=True),
                       plan=plan, param_dtype=torch.bfloat16, orig_dtype=torch.float32,
                       reduce_dtype=torch.float32, shapes=shapes)
        arena = Arena(placement.assign([tg]), device, rank=rank, world=world, fabric=True)
        placement.bind([tg], arena)
        handles: list = [None] * world
        dist.all_gather_object(handles, arena.ipc_handle())
        arena.open_peers(handles)
        transport = comm.make_transport(arena, [None] * world, rank, topo, group_of=None)
        layout = plan.layout
        shards = [torch.randn(pl.e, device=device) for pl in layout.params]
        grads = [torch.randn(s, device=device).to(torch.bfloat16) for s in shapes]
        out = torch.zeros(layout.E, device=device)
        times = {"ag": [], "rs": []}
        for it in range(args.iters + 1):
            for what in ("ag", "rs"):
                torch.cuda.synchronize(device)
                dist.barrier()
                t0 = time.perf_counter()
                if what == "ag":
                    transport.all_gather(tg, shards, tg.landing_views)
                else:
                    transport.reduce_scatter(tg, plan, grads, out, 1.0 / world)
                times[what].append(time.perf_counter() - t0)
        transport.synchronize()
        dist.barrier()
        gathered: list = [None] * world
        dist.all_gather_object(gathered, times)
        if rank == 0:
            res = {"model": args.model, "group": args.group, "ranks": world, "gpus": ngpu,
                   "mode": args.mode, "transport": transport.name, "iters": args.iters,
                   "torch": torch.__version__, "device": torch.cuda.get_device_name(device)}
            for what in ("ag", "rs"):
                steady = [t for r in gathered for t in r[what][1:]]
                first = [r[what][0] for r in gathered]
                res[what] = {"median_us": statistics.median(steady) * 1e6,
                             "p90_us": sorted(steady)[int(0.9 * (len(steady) - 1))] * 1e6,
                             "first_call_ms": max(first) * 1e3}
            with open(out_path, "w") as f:
                json.dump(res, f)
        del transport
        arena.close()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tide bench hostcall", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="processes (ranks of one node)")
    ap.add_argument("--model", default="llama3.1-70b")
    ap.add_argument("--group", default="block")
    ap.add_argument("--mode", default="in_place", choices=("in_place", "slot_reuse"))
    ap.add_argument("--iters", type=int, default=30, help="timed calls per collective")
    ap.add_argument("--json", default=None, help="write the result to this path")
    args = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp
    if not torch.cuda.is_available():
        print("tide bench hostcall: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.ranks < 1 or args.iters < 1:
        ap.error("--ranks and --iters must be >= 1")
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
    print(f"# tide_torch CUDA path, host time per call: {res['model']} {res['group']}, "
          f"{res['ranks']} ranks on {res['gpus']} GPU(s) ({res['device']}), {res['mode']}, "
          f"transport {res['transport']}, torch {res['torch']}, {res['iters']} calls per rank")
    print(f"{'call':6s} {'median us':>10s} {'p90 us':>10s} {'first call ms':>14s}")
    for what in ("ag", "rs"):
        r = res[what]
        print(f"{what:6s} {r['median_us']:10.1f} {r['p90_us']:10.1f} {r['first_call_ms']:14.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
