"""`tide bench interference`: how much a collective slows concurrent compute (paper Tables 4, 6).

Victims, each timed alone and while a collective loops on other streams:
  one-wave GEMM   256 x 8192 x 8192 bf16 (torch.matmul; about one wave of output tiles)
  28-wave GEMM    14848 x 8192 x 8192 bf16 (about 28 waves of 128 x 256 tiles on 132 SMs)
  elementwise     256 MiB fp32 in, 256 MiB out (torch.mul)
Collectives: TIDE-RS (training CTA budget 16 + 4, and 4 + 4), TIDE-AG, FSDP2 stock RS and AG,
bare RS on pre-packed fp32. Columns: collective time alone and during each victim, victim
slowdown %, SM*ms per call per rank (kernels' min(CTAs, SMs) x duration from torch.profiler;
copies on copy engines cost no SMs; on one GPU same-GPU copies are listed by the profiler as
copies and not counted either).
Contexts as in common.py: on one GPU the collectives are TIDE on N virtual ranks and the stock
layout steps of all N ranks (packed reduce kernels + copies) on the same GPU; with >= 2 GPUs the
stock rows are NCCL in spawned processes (victim on rank 0's GPU), TIDE drives every GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time

from tide_apps.bench import collectives as coll
from tide_apps.bench import common
from tide_apps.bench.common import MIB, progress

GPU_VICTIMS = {"one-wave GEMM": ("gemm", 256, 8192, 8192), "28-wave GEMM": ("gemm", 14848, 8192, 8192),
               "elementwise 256 MiB": ("ew", 64 * MIB)}
CPU_VICTIMS = {"one-wave GEMM": ("gemm", 16, 256, 256), "28-wave GEMM": ("gemm", 128, 256, 256),
               "elementwise 256 MiB": ("ew", 256 * 1024)}  # emulation: tiny stand-ins


def make_victims(torch, spec, dev):
    out = {}
    for name, v in spec.items():
        if v[0] == "gemm":
            _, m, k, n = v
            a = torch.randn(m, k, device=dev).to(torch.bfloat16)
            b = torch.randn(k, n, device=dev).to(torch.bfloat16)
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            out[name] = (lambda a=a, b=b, c=c: torch.matmul(a, b, out=c))
        else:
            x = torch.randn(v[1], device=dev)
            y = torch.empty_like(x)
            out[name] = (lambda x=x, y=y: torch.mul(x, 1.0001, out=y))
    return out


def time_victim(torch, fn, reps, cuda, stream=None):
    if not cuda:
        return common.time_wall(fn, reps, 3)
    with torch.cuda.stream(stream):
        return common.time_cuda(torch, fn, reps, 2)


class Looper:
    """Runs a synchronous collective call over and over in a thread; records each call's ms."""

    def __init__(self, fn):
        self.fn, self.stop, self.ms = fn, threading.Event(), []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self.stop.is_set():
            t = time.perf_counter()
            self.fn()
            self.ms.append((time.perf_counter() - t) * 1e3)

    def __enter__(self):
        self.thread.start()
        while not self.ms and self.thread.is_alive():  # the collective is under way first
            time.sleep(0.001)
        self.ms.clear()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=120)


def _local_collectives(torch, ctx, args, shapes_rs, shapes_ag, N, cuda):
    """{name: (synchronous call, CTA label)} for the cpu / gpu1 / multi (TIDE only) contexts."""
    import tide
    dev = "cuda:0" if cuda else "cpu"
    side = torch.cuda.Stream() if cuda else None
    out = {}
    devices = list(range(ctx.gpus)) if ctx.kind == "multi" else [0]
    topo = tide.Topology(1, N)
    for label, sc, lc in (("TIDE-RS, training (16+4)", 16, 4), ("TIDE-RS, 4+4", 4, 4)):
        plan = tide.plan(tide.GroupSignature(shapes=shapes_rs), topo)
        grads = coll._make_grads(torch, shapes_rs, N, dev)
        if cuda:
            vc = tide.VirtualCluster(topo, backend="cuda", check=False, devices=devices, sum_ctas=sc, land_ctas=lc)
            grads = [[x.to(f"cuda:{vc.device_of(r)}") for x in row] for r, row in enumerate(grads)]
            _, go = vc.reduce_scatter_runner(plan, grads, scale=1.0 / N)
        else:
            vc = tide.VirtualCluster(topo, backend="cpu", check=False)
            np_g = [[coll._np_bf16(x) for x in row] for row in grads]
            go = (lambda vc=vc, plan=plan, np_g=np_g: vc.reduce_scatter(plan, np_g, scale=1.0 / N))
        out[label] = (go, f"{sc} + {lc}")
    plan = tide.plan(tide.GroupSignature(shapes=shapes_ag), topo)
    shards = coll._make_shards(torch, shapes_ag, N, dev)
    if cuda:
        vc = tide.VirtualCluster(topo, backend="cuda", check=False, devices=devices)
        shards = [[s.to(f"cuda:{vc.device_of(r)}") for s in row] for r, row in enumerate(shards)]
        _, go, _ = vc.all_gather_runner(plan, shards)
    else:
        vc = tide.VirtualCluster(topo, backend="cpu", check=False)
        np_s = [[coll._np_bf16(s) for s in row] for row in shards]
        go = (lambda vc=vc, plan=plan, np_s=np_s: vc.all_gather(plan, np_s))
    out["TIDE-AG"] = (go, "0 (copies)")
    if ctx.kind == "multi":
        return out
    for op, shapes in (("rs", shapes_rs), ("ag", shapes_ag)):
        sh = coll._make_shards(torch, shapes, N, dev) if op == "ag" else None
        gr = coll._make_grads(torch, shapes, N, dev) if op == "rs" else None
        paths, _ = coll._stock_local(torch, op, shapes, N, dev, sh, gr)
        for name, fn in paths.items():
            label = f"{op.upper()} {name}" + (" (emulated, 1 GPU)" if cuda else "")

            def call(fn=fn):
                if cuda:
                    with torch.cuda.stream(side):
                        fn()
                    side.synchronize()
                else:
                    fn()
            out[label] = (call, "all SMs (torch kernels)")
    return out


def _measure(torch, name, call, ctas, victims, alone, args, cuda, n_sm, N, vstream):
    from tide_apps.bench.layout import _profile
    row = dict(config=name, ctas=ctas)
    ts = common.time_wall(call, max(5, args.reps // 2), 2)
    row["alone_ms"] = statistics.median(ts)
    if cuda:
        _, _, smms = _profile(torch, call, n_sm)
        row["sm_ms"] = smms / N
    for vname, vfn in victims.items():
        with Looper(call) as lp:
            ts = time_victim(torch, vfn, args.reps, cuda, vstream)
        conc = statistics.median(ts)
        row[f"slow:{vname}"] = 100.0 * (conc / alone[vname] - 1.0)
        row[f"coll:{vname}"] = statistics.median(lp.ms) if lp.ms else None
    return row


def _nccl_worker(rank, world, shapes_rs, shapes_ag, vspec, reps, port, q, max_ctas=None):
    if max_ctas:  # read by NCCL when the communicator is created (Table 4's CTA-limited rows)
        os.environ["NCCL_MAX_CTAS"] = str(max_ctas)
    import torch
    import torch.distributed as dist
    from tide_apps.bench.layout import _profile
    dev = coll.nccl_init(rank, world, port)
    paths = {}
    for op, shapes in (("rs", shapes_rs), ("ag", shapes_ag)):
        p, _, _ = coll.nccl_paths(op, shapes, world, dev, rank)
        limit = f", <= {max_ctas} CTAs" if max_ctas else ""
        paths.update({f"{op.upper()} {k} (NCCL{limit})": v for k, v in p.items() if "SymmMem" not in k})
    victims = make_victims(torch, vspec, dev) if rank == 0 else {}
    vstream, cstream = torch.cuda.Stream(), torch.cuda.Stream()
    n_sm = torch.cuda.get_device_properties(rank).multi_processor_count
    alone = {k: statistics.median(time_victim(torch, f, reps, True, vstream)) for k, f in victims.items()}
    rows = []
    for name, fn in paths.items():
        with torch.cuda.stream(cstream):
            ts = common.time_cuda(torch, fn, 5, 2)
        row = dict(config=name, ctas=f"NCCL <= {max_ctas}" if max_ctas else "NCCL default",
                   alone_ms=statistics.median(ts))
        with torch.cuda.stream(cstream):  # every rank: the profiled calls are collectives
            row["sm_ms"] = _profile(torch, fn, n_sm)[2]
        for vname in vspec:
            n = torch.tensor([0], device=dev)
            if rank == 0:
                n[0] = math.ceil(2 * alone[vname] * reps / row["alone_ms"]) + 4
            dist.broadcast(n, 0)
            torch.cuda.synchronize()
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(cstream):
                a.record()
                for _ in range(int(n.item())):
                    fn()
                b.record()
            if rank == 0:
                evs = []
                with torch.cuda.stream(vstream):
                    for _ in range(reps):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        victims[vname]()
                        e1.record()
                        evs.append((e0, e1))
                torch.cuda.synchronize()
                conc = statistics.median(e0.elapsed_time(e1) for e0, e1 in evs)
                row[f"slow:{vname}"] = 100.0 * (conc / alone[vname] - 1.0)
                row[f"coll:{vname}"] = a.elapsed_time(b) / int(n.item())
            torch.cuda.synchronize()
        rows.append(row)
    if rank == 0:
        q.put((alone, rows))
    dist.barrier()
    dist.destroy_process_group()


def _nccl_rows(shapes_rs, shapes_ag, vspec, world, reps, max_ctas=None):
    import random

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = random.randint(20000, 40000)
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, shapes_rs, shapes_ag, vspec, reps, port, q,
                                                    max_ctas))
             for r in range(world)]
    for p in procs:
        p.start()
    return common.collect(procs, q, 1, 300)[0]


def _nccl_ctas(spec):
    """--nccl-ctas "default,8,4" -> [None, 8, 4]: NCCL's CTA limits (NCCL_MAX_CTAS) to sweep."""
    out = []
    for item in (spec or "default").split(","):
        item = item.strip()
        if item == "default":
            out.append(None)
        elif item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            raise SystemExit(f"--nccl-ctas: {item!r} is neither 'default' nor a positive CTA count")
    return out


def run(args) -> dict:
    import torch
    _nccl_ctas(args.nccl_ctas)  # a bad --nccl-ctas fails before any measurement
    ctx = common.detect_context(args.context, args.ranks or 8)
    cuda = not ctx.emulation
    N = ctx.gpus if ctx.kind == "multi" else (args.ranks or (8 if cuda else 4))
    ctx = common.detect_context(args.context, N)
    shard = int(float(args.shard or (32 if cuda else 0.0625)) * MIB)
    args.reps = args.reps or (30 if cuda else 5)
    vspec = GPU_VICTIMS if cuda else CPU_VICTIMS
    print(f"# tide bench interference: {ctx.label}; {shard / MIB:g} MiB shards")
    _, shapes_rs = coll._group("rs", shard, 16, N)
    _, shapes_ag = coll._group("ag", shard, 30, N)
    dev = "cuda:0" if cuda else "cpu"
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 0
    vstream = torch.cuda.Stream() if cuda else None
    victims = make_victims(torch, vspec, dev)
    alone = {k: statistics.median(time_victim(torch, f, args.reps, cuda, vstream)) for k, f in victims.items()}
    progress("victims alone: " + ", ".join(f"{k} {v:.3f} ms" for k, v in alone.items()))
    rows = []
    for name, (call, ctas) in _local_collectives(torch, ctx, args, shapes_rs, shapes_ag, N, cuda).items():
        progress(f"interference: {name}")
        rows.append(_measure(torch, name, call, ctas, victims, alone, args, cuda, n_sm, N, vstream))
    if ctx.kind == "multi":
        progress("interference: NCCL stock paths (spawned, victim on rank 0's GPU)")
        del victims
        torch.cuda.empty_cache()
        for limit in _nccl_ctas(args.nccl_ctas):
            try:
                _, nrows = _nccl_rows(shapes_rs, shapes_ag, vspec, N, args.reps, limit)
                rows += nrows
            except Exception as ex:  # noqa: BLE001 - reported as a row
                rows.append(dict(config=f"NCCL stock paths ({limit or 'default'} CTAs)",
                                 note=f"failed: {type(ex).__name__}: {ex}"))
    result = dict(bench="interference", context=ctx.kind, label=ctx.label, device=ctx.device, world=N,
                  shard_mib=shard / MIB, victims_alone_ms=alone, rows=rows)
    tide_rs = next((r for r in rows if r["config"].startswith("TIDE-RS, training")), None)
    if tide_rs and "slow:one-wave GEMM" in tide_rs:
        v = tide_rs["slow:one-wave GEMM"]
        beside = {r["config"]: r["slow:one-wave GEMM"] for r in rows
                  if r["config"].startswith("RS ") and "slow:one-wave GEMM" in r}
        result["target"] = dict(target="one-wave GEMM slowdown during TIDE-RS <= 5%", value=v, met=v <= 5.0,
                                stock_beside=beside, emulation=ctx.emulation)
    _print(result, list(vspec))
    return result


def _print(result, vnames):
    pct = lambda v: f"{v:+.1f}%"  # noqa: E731
    cols = [("config", "collective", 40, str), ("ctas", "CTAs", 14, str), ("alone_ms", "alone ms", 9, ".3f"),
            ("sm_ms", "SM*ms/call", 10, ".2f")]
    for v in vnames:
        cols += [(f"coll:{v}", f"ms|{v[:8]}", 12, ".3f"), (f"slow:{v}", f"slow {v[:12]}", 18, pct)]
    cols.append(("note", "note", 1, str))
    common.print_table(result["rows"], cols)
    print("# victims alone (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in result["victims_alone_ms"].items()))
    t = result.get("target")
    if t:
        print(f"# target: {t['target']}: {t['value']:+.1f}% ({'met' if t['met'] else 'NOT met'}); "
              f"beside it: {', '.join(f'{k} {x:+.1f}%' for k, x in t['stock_beside'].items()) or 'n/a'}"
              + (" [EMULATION: not a GPU figure]" if t.get("emulation") else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tide bench interference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--shard", default=None, help="shard MiB (default 32; CPU 0.0625)")
    ap.add_argument("--ranks", type=int, default=0, help="virtual ranks without >= 2 GPUs (default 8; CPU 4)")
    ap.add_argument("--nccl-ctas", default="default", metavar="default,8,4",
                    help=">= 2 GPUs: the NCCL rows under these CTA limits (NCCL_MAX_CTAS; Table 4)")
    args = ap.parse_args(argv)
    try:
        with common.cpu_threads(args.context):
            result = run(args)
    except ValueError as ex:
        print(f"tide bench interference: error: {ex}", file=sys.stderr)
        return 2
    common.write_json(args.json, result)
    if args.plot:
        groups = {}
        for r in result["rows"]:
            for k, v in r.items():
                if k.startswith("slow:") and v is not None:
                    groups.setdefault(k[5:], {})[r["config"][:26]] = v
        common.bar_plot(args.plot, f"victim slowdown % ({result['label'].split(';')[0]})", groups, "slowdown %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
