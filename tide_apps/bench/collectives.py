"""`tide bench ag` and `tide bench rs`: latency tables shaped like the paper's Tables 7 and 8.

AG (P = 30 bf16 tensors per group, shard S per rank):
  TIDE-AG            direct parameter-major landing (no copy-out; 0 SMs between GPUs)
  FSDP2 stock        NCCL all_gather_into_tensor into a rank-major buffer + split_with_sizes_copy
  FSDP2+SymmMem      torch symmetric-memory copy-engine all-gather + split_with_sizes_copy
  bare NCCL AG       all_gather_into_tensor on pre-packed input, no copy-out (not FSDP2's layout)
RS (P = 16 bf16 gradients, fp32 output shard S per rank, alpha = 1/N):
  TIDE-RS            per-parameter gradients in, fp32 shard out
  FSDP2 stock        torch._chunk_cat (bf16 -> fp32 pack) + NCCL reduce_scatter_tensor (avg)
  FSDP2+SymmMem      _chunk_cat + symmetric-memory low-contention reduce-scatter
  bare NCCL RS       reduce_scatter_tensor on pre-packed fp32 input
Columns: min and median ms, extra buffer per GPU beyond the parameters / gradients (AG: the
rank-major output or TIDE's receive stage; RS: FSDP2's fp32 pack or TIDE's Area_RS), nccl-tests'
algbw / busbw (size = N * S for AG, N * S_fp32 for RS; busbw = algbw * (N - 1) / N) and the
speed-up of each row over FSDP2 stock (median / median). TIDE rows are host wall clock (enqueue
plus the wait for every rank's streams), stock rows CUDA events: the comparison favours stock.
"""
from __future__ import annotations

import argparse
import os
import sys

from tide_apps.bench import common
from tide_apps.bench.common import MIB, progress

STOCK = "FSDP2 stock"
SYMM = "FSDP2+SymmMem"
TIDE = "TIDE"


def _defaults(args, ctx, op):
    if ctx.kind == "cpu":
        args.sizes = args.sizes or "0.0625,0.25"
        args.reps, args.warmup = args.reps or 5, args.warmup or 1
        args.ranks = args.ranks or 4
    else:
        args.sizes = args.sizes or "32,128"
        args.reps, args.warmup = args.reps or 20, args.warmup or 3
        args.ranks = args.ranks or 8
    args.params = args.params or (30 if op == "ag" else 16)
    if ctx.kind == "multi":
        args.ranks = ctx.gpus


def _group(op, shard_bytes, P, N):
    """(signature, shapes, E) for a group whose per-rank shard is shard_bytes (AG: bf16 shard;
    RS: fp32 output shard)."""
    from tide.plan import GroupSignature
    unsharded_bytes = shard_bytes if op == "ag" else shard_bytes // 2  # bf16 gradients
    shapes = common.group_shapes(unsharded_bytes, P, N, 2)
    return GroupSignature(shapes=shapes), shapes


def _topologies(ctx, N, spec=None):
    """The TIDE rows' topologies: `spec` "MxL,..." (e.g. "1x8,2x4,4x2,8x1": emulated node splits
    of N ranks, so rails, Bruck rounds and Latin-square waves run on real peers), else 1 x N, and
    N x 1 too with >= 2 GPUs."""
    import tide
    if spec:
        out = []
        for item in spec.split(","):
            try:
                m, l = (int(x) for x in item.lower().split("x"))
            except ValueError:
                raise SystemExit(f"--topologies: {item!r} is not MxL (nodes x GPUs per node)") from None
            if m < 1 or l < 1 or m * l != N:
                raise SystemExit(f"--topologies: {item} has {m * l} ranks, this run has N = {N}")
            out.append((f"{m} node{'s' if m > 1 else ''} x {l}", tide.Topology(m, l)))
        return out
    if ctx.kind == "multi":
        return [("1 node x %d" % N, tide.Topology(1, N)), ("%d nodes x 1" % N, tide.Topology(N, 1))]
    return [("1 node x %d" % N, tide.Topology(1, N))]


# ---- inputs and references -----------------------------------------------------------------
def _make_shards(torch, shapes, N, dev, seed=1):
    """shards[r][p]: rank r's rows of parameter p (rows padded to a multiple of N), made on `dev`
    (a CUDA generator there: host randn of GiBs would take longer than the bench)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    return [[torch.randn(-(-D // N), K, generator=g, device=dev).to(torch.bfloat16) for D, K in shapes]
            for _ in range(N)]


def _make_grads(torch, shapes, N, dev, seed=2):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [[torch.randn(D, K, generator=g, device=dev).to(torch.bfloat16) for D, K in shapes] for _ in range(N)]


def _np_bf16(t):
    import ml_dtypes
    import torch
    t = t.contiguous()
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def _as_torch(torch, x):
    """A TIDE output (torch tensor, or numpy from the CPU cluster) as a torch tensor."""
    if hasattr(x, "data_ptr"):
        return x
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view("int16").copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _check_ag(torch, shapes, shards, full, ranks):
    """TIDE's landing of every checked rank equals FSDP2's copy-out bit for bit (compared on the
    output's device)."""
    for r in ranks:
        for p, (D, K) in enumerate(shapes):
            got = _as_torch(torch, full[r][p])
            ref = torch.cat([shards[u][p].to(got.device) for u in range(len(shards))])[:D]
            if not torch.equal(ref.view(torch.int16), got.reshape(ref.shape).view(torch.int16)):
                return f"rank {r} param {p} differs from the copy-out"
    return "bitwise"


def _check_rs(torch, shapes, grads, outs, plan, ranks):
    """TIDE-RS shard of each checked rank against an fp32 reference of the averaged gradients
    (max |diff| / max |ref| over the parameters), computed on the output's device."""
    N = len(grads)
    lay = plan.layout
    worst = 0.0
    for r in ranks:
        got = _as_torch(torch, outs[r])
        for p, (D, K) in enumerate(shapes):
            pl = lay.params[p]
            lo, hi = r * pl.e, min((r + 1) * pl.e, D * K)  # rank r's rows of p, unpadded part
            ref = torch.zeros(pl.e, dtype=torch.float32, device=got.device)
            if hi > lo:
                for u in range(N):
                    ref[:hi - lo] += grads[u][p].reshape(-1)[lo:hi].to(got.device).float()
                ref /= N
            d = (got[pl.o32:pl.o32 + pl.e] - ref).abs().max().item()
            worst = max(worst, d / max(ref.abs().max().item(), 1e-30))
    return worst


# ---- stock paths on one device (cpu / gpu1: every rank's work on this device) --------------
def _stock_local(torch, op, shapes, N, dev, shards=None, grads=None):
    """{row name: callable} for the stock layout steps of all N ranks on one device."""
    e = [-(-D // N) * K for D, K in shapes]
    E = sum(e)
    if op == "ag":
        packed = torch.cat([torch.cat([s.reshape(-1) for s in shards[u]]) for u in range(N)]).view(N, E)
        ag_out = torch.empty(N, N * E, dtype=torch.bfloat16, device=dev)  # rank r's rank-major output
        params = [torch.empty(N, N * ep, dtype=torch.bfloat16, device=dev) for ep in e]
        outs = [x.view(N * N, ep) for x, ep in zip(params, e)]

        def bare():
            ag_out.copy_(packed.view(1, -1).expand(N, -1))

        def stock():
            bare()
            torch.split_with_sizes_copy(ag_out.view(N * N, E), e, dim=1, out=outs)
        return {STOCK: stock, "bare AG (pre-packed)": bare}, dict(E=E, extra=N * E * 2)
    packed = torch.empty(N, N, E, dtype=torch.float32, device=dev)
    out = torch.empty(N, E, dtype=torch.float32, device=dev)

    def pack():
        for u in range(N):
            torch._chunk_cat(grads[u], dim=0, num_chunks=N, out=packed[u])

    def bare():
        torch.sum(packed, dim=0, out=out)
        out.mul_(1.0 / N)

    def stock():
        pack()
        bare()
    pack()
    return {STOCK: stock, "bare RS fp32 (pre-packed)": bare}, dict(E=E, extra=N * E * 4)


# ---- stock paths over NCCL (multi: one spawned process per GPU) ----------------------------
def nccl_init(rank, world, port, backend="nccl"):
    """Joins the stock paths' process group: NCCL with rank r on GPU r (backend="gloo" on the
    CPU: tests of the orchestration)."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if backend == "gloo":
        dist.init_process_group("gloo", rank=rank, world_size=world)
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    return dev


def _agree(torch, dist, dev, paths, notes, name):
    """Every rank times a path or none does (a path on some ranks only would hang the group)."""
    t = torch.tensor([1 if name in paths else 0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    if not t.item() and name in paths:
        del paths[name]
        notes[name] = "not available: failed on another rank"


def nccl_paths(op, shapes, N, dev, rank):
    """{row name: callable} of the stock paths of this rank (inside an NCCL process group),
    {row name: 'not available: ...'} and E (elements of the packed per-rank shard)."""
    import torch
    import torch.distributed as dist
    e = [-(-D // N) * K for D, K in shapes]
    E = sum(e)
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    paths, notes = {}, {}
    avg = dist.ReduceOp.AVG if dev.type == "cuda" else dist.ReduceOp.SUM  # gloo has no AVG
    if op == "ag":
        shard = torch.randn(E, generator=g, device=dev).to(torch.bfloat16)
        ag_out = torch.empty(N * E, dtype=torch.bfloat16, device=dev)
        outs = [torch.empty(N * ep, dtype=torch.bfloat16, device=dev).view(N, ep) for ep in e]
        paths[STOCK] = lambda: (dist.all_gather_into_tensor(ag_out, shard),
                                torch.split_with_sizes_copy(ag_out.view(N, E), e, dim=1, out=outs))
        paths["bare NCCL AG (pre-packed)"] = lambda: dist.all_gather_into_tensor(ag_out, shard)
        try:
            import torch.distributed._symmetric_memory as symm_mem
            name = dist.group.WORLD.group_name
            inp = symm_mem.empty(E, dtype=torch.bfloat16, device=dev)
            inp.copy_(shard)
            symm_mem.rendezvous(inp, name)

            def symm():
                full = torch.ops.symm_mem._low_contention_all_gather(inp, name)
                torch.split_with_sizes_copy(full.view(N, E), e, dim=1, out=outs)
            symm()
            paths[SYMM + ": CE AG + copy-out"] = symm
        except Exception as ex:  # noqa: BLE001 - reported as a row
            notes[SYMM + ": CE AG + copy-out"] = f"not available: {type(ex).__name__}: {str(ex)[:120]}"
        _agree(torch, dist, dev, paths, notes, SYMM + ": CE AG + copy-out")
    else:
        grads = [torch.randn(D, K, generator=g, device=dev).to(torch.bfloat16) for D, K in shapes]
        packed = torch.empty(N, E, dtype=torch.float32, device=dev)
        out = torch.empty(E, dtype=torch.float32, device=dev)
        pack = lambda: torch._chunk_cat(grads, dim=0, num_chunks=N, out=packed)  # noqa: E731
        paths[STOCK] = lambda: (pack(), dist.reduce_scatter_tensor(out, packed.view(-1), op=avg))
        pack()
        paths["bare NCCL RS fp32 (pre-packed)"] = lambda: dist.reduce_scatter_tensor(out, packed.view(-1),
                                                                                      op=avg)
        try:
            import torch.distributed._symmetric_memory as symm_mem
            name = dist.group.WORLD.group_name
            sp = symm_mem.empty(N * E, dtype=torch.float32, device=dev)
            symm_mem.rendezvous(sp, name)

            def symm():
                torch._chunk_cat(grads, dim=0, num_chunks=N, out=sp.view(N, E))
                return torch.ops.symm_mem._low_contention_reduce_scatter(sp, "avg", name)
            symm()
            paths[SYMM + ": _chunk_cat + LC RS"] = symm
        except Exception as ex:  # noqa: BLE001
            notes[SYMM + ": _chunk_cat + LC RS"] = f"not available: {type(ex).__name__}: {str(ex)[:120]}"
        _agree(torch, dist, dev, paths, notes, SYMM + ": _chunk_cat + LC RS")
    return paths, notes, E


def _nccl_worker(rank, world, op, shapes, reps, warmup, port, q, backend="nccl"):
    import torch
    import torch.distributed as dist
    dev = nccl_init(rank, world, port, backend)
    paths, notes, E = nccl_paths(op, shapes, world, dev, rank)
    res = {}
    for name, fn in paths.items():
        if dev.type == "cpu":
            res[name] = common.time_wall(lambda: (dist.barrier(), fn()), reps, warmup)
            continue
        res[name] = common.time_cuda(torch, fn, reps, warmup, before=dist.barrier)
    q.put((rank, res, notes, E))
    dist.barrier()
    dist.destroy_process_group()


def _stock_nccl(op, shapes, world, reps, warmup, backend="nccl"):
    """Per-rep max over ranks of each stock path; notes for paths that are not available."""
    import random

    import torch.multiprocessing as mp
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = random.randint(20000, 40000)
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, op, shapes, reps, warmup, port, q, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    got = common.collect(procs, q, world, 240)
    times = {}
    for _, res, _, _ in got:
        for k, ts in res.items():
            times[k] = [max(a, b) for a, b in zip(times[k], ts)] if k in times else ts
    return times, got[0][2], got[0][3]


# ---- TIDE ----------------------------------------------------------------------------------
def _tide_rows(op, ctx, torch, topo_name, topo, sig, shapes, N, reps, warmup):
    import tide
    plan = tide.plan(sig, topo)
    mem = plan.memory()
    if ctx.emulation:
        vc = tide.VirtualCluster(topo, backend="cpu", check=False)
        if op == "ag":
            shards = _make_shards(torch, shapes, N, "cpu")
            np_sh = [[_np_bf16(s) for s in row] for row in shards]
            full = vc.all_gather(plan, np_sh)
            go = lambda: vc.all_gather(plan, np_sh)  # noqa: E731
        else:
            grads = _make_grads(torch, shapes, N, "cpu")
            np_g = [[_np_bf16(x) for x in row] for row in grads]
            outs = vc.reduce_scatter(plan, np_g, scale=1.0 / N)
            go = lambda: vc.reduce_scatter(plan, np_g, scale=1.0 / N)  # noqa: E731
        ts = common.time_wall(go, reps, warmup)
    else:
        devices = list(range(ctx.gpus)) if ctx.kind == "multi" else [0]
        vc = tide.VirtualCluster(topo, backend="cuda", check=False, devices=devices)
        if op == "ag":
            shards = [[s.to(f"cuda:{vc.device_of(r)}") for s in row]
                      for r, row in enumerate(_make_shards(torch, shapes, N, "cuda:0"))]
            full, go, _ = vc.all_gather_runner(plan, shards)
        else:
            grads = [[x.to(f"cuda:{vc.device_of(r)}") for x in row]
                     for r, row in enumerate(_make_grads(torch, shapes, N, "cuda:0"))]
            outs, go = vc.reduce_scatter_runner(plan, grads, scale=1.0 / N)
        ts = common.time_wall(go, reps, warmup)
    check_ranks = sorted({0, N - 1})
    if op == "ag":
        check = _check_ag(torch, shapes, shards, full, check_ranks)
        extra = mem["stage_bytes"]
    else:
        err = _check_rs(torch, shapes, grads, outs, plan, check_ranks)
        check = f"max rel err {err:.1e}" + ("" if err < 1e-2 else " (TOO LARGE)")
        extra = mem["area_rs_bytes"]
    row = dict(path=f"{TIDE}-{op.upper()} ({topo_name})", extra_bytes=extra, check=check,
               E=plan.layout.E, **common.stats(ts))
    if op == "rs":
        row["rel_err"] = err
    return row


def measure_p2p(torch, ctx, nbytes=256 * MIB, reps=10):
    """Copy bandwidth GB/s GPU0 -> GPU1 (multi) or GPU0 -> GPU0 (gpu1); None on the CPU."""
    if ctx.emulation:
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1" if ctx.kind == "multi" else "cuda:0")
    ms = common.stats(common.time_cuda(torch, lambda: b.copy_(a), reps, 2))["med_ms"]
    return nbytes / ms / 1e6


def run(op, args) -> dict:
    import torch
    ctx = common.detect_context(args.context, args.ranks or 8)
    _defaults(args, ctx, op)
    N = args.ranks
    ctx = common.detect_context(args.context, N)
    _topologies(ctx, N, args.topologies)  # a bad --topologies fails before any measurement
    print(f"# tide bench {op}: {ctx.label}")
    result = dict(bench=op, context=ctx.kind, label=ctx.label, device=ctx.device, world=N,
                  P=args.params, reps=args.reps, rows=[], targets=[])
    p2p = measure_p2p(torch, ctx) if op == "ag" else None
    result["p2p_gbps"] = p2p
    for mib in [float(x) for x in args.sizes.split(",")]:
        shard = int(mib * MIB)
        sig, shapes = _group(op, shard, args.params, N)
        progress(f"{op} {mib:g} MiB: {len(shapes)} tensors, N = {N}")
        rows = []
        if ctx.kind == "multi":
            times, notes, E = _stock_nccl(op, shapes, N, args.reps, args.warmup)
            for name, ts in times.items():
                extra = N * E * (2 if op == "ag" else 4)
                rows.append(dict(path=name, extra_bytes=extra + (E * 2 if SYMM in name and op == "ag" else 0),
                                 **common.stats(ts)))
            rows += [dict(path=k, note=v) for k, v in notes.items()]
        else:
            dev = "cpu" if ctx.emulation else "cuda:0"
            shards = _make_shards(torch, shapes, N, dev) if op == "ag" else None
            grads = _make_grads(torch, shapes, N, dev) if op == "rs" else None
            paths, info = _stock_local(torch, op, shapes, N, dev, shards, grads)
            for name, fn in paths.items():
                ts = (common.time_wall(fn, args.reps, args.warmup) if ctx.emulation
                      else common.time_cuda(torch, fn, args.reps, args.warmup))
                rows.append(dict(path=name, extra_bytes=info["extra"], **common.stats(ts)))
            why = "needs >= 2 GPUs (CUDA symmetric memory)" if not ctx.emulation else "needs CUDA GPUs"
            rows.append(dict(path=SYMM, note=f"not available: {why}"))
            del paths, shards, grads
            if not ctx.emulation:
                torch.cuda.empty_cache()
        for k, (topo_name, topo) in enumerate(_topologies(ctx, N, args.topologies)):
            progress(f"{op} {mib:g} MiB: TIDE on {topo_name}")
            try:
                rows.insert(k, _tide_rows(op, ctx, torch, topo_name, topo, sig, shapes, N, args.reps, args.warmup))
            except Exception as ex:  # noqa: BLE001 - a topology the planner or fabric refuses is a row
                rows.insert(k, dict(path=f"{TIDE}-{op.upper()} ({topo_name})",
                                    note=f"not available: {type(ex).__name__}: {str(ex)[:120]}"))
            if not ctx.emulation:
                torch.cuda.empty_cache()
        stock = next((r for r in rows if r["path"] == STOCK), None)
        for r in rows:
            r["shard_mib"] = mib
            if "med_ms" in r:
                size = N * shard
                r.update(common.bw_columns(size, r["med_ms"], N))
                r["vs_stock"] = common.ratio(stock and stock["med_ms"], r["med_ms"])
        result["rows"] += rows
        result["targets"] += _targets(op, rows, mib, p2p)
    _print(op, result)
    return result


def _targets(op, rows, mib, p2p):
    tide_rows = [r for r in rows if r["path"].startswith(TIDE) and "med_ms" in r]
    if not tide_rows:
        return []
    t = min(tide_rows, key=lambda r: r["med_ms"])
    out = []
    if op == "ag":
        fsdp = [r for r in rows if "med_ms" in r and (r["path"] == STOCK or "copy-out" in r["path"])]
        if fsdp:
            best = min(fsdp, key=lambda r: r["med_ms"])
            v = best["med_ms"] / t["med_ms"]
            out.append(dict(shard_mib=mib, target="AG >= 1.2x best FSDP2 path with copy-out",
                            value=v, goal=1.2, met=v >= 1.2, vs=best["path"]))
        if p2p:
            v = t["busbw"] / p2p
            out.append(dict(shard_mib=mib, target="AG busbw >= 85% of measured P2P bandwidth",
                            value=v, goal=0.85, met=v >= 0.85, vs=f"{p2p:.0f} GB/s"))
    else:
        for name, goal in ((STOCK, 1.4), ("bare", 1.0)):
            ref = next((r for r in rows if r["path"].startswith(name) and "med_ms" in r), None)
            if ref:
                v = ref["med_ms"] / t["med_ms"]
                out.append(dict(shard_mib=mib, target=f"RS >= {goal}x {ref['path']}", value=v, goal=goal,
                                met=v >= goal, vs=ref["path"]))
    return out


def _print(op, result):
    cols = [("path", "path", 42, str), ("shard_mib", "shard MiB", 9, "g"), ("min_ms", "min ms", 9, ".3f"),
            ("med_ms", "med ms", 9, ".3f"), ("extra_bytes", "buffer/GPU", 11, common.fmt_bytes),
            ("algbw", "algbw", 8, ".1f"), ("busbw", "busbw", 8, ".1f"), ("vs_stock", "vs stock", 8, ".2f"),
            ("check", "check", 22, str), ("note", "note", 1, str)]
    common.print_table(result["rows"], cols)
    print("# TIDE rows: host wall clock of enqueue + wait for every rank's streams; stock rows: CUDA events"
          + (" (max over ranks per call)" if result["context"] == "multi" else "")
          + ("; all wall clock on the CPU" if result["context"] == "cpu" else ""))
    if result.get("p2p_gbps"):
        print(f"# measured copy bandwidth GPU0 -> {'GPU1' if result['context'] == 'multi' else 'GPU0'}: "
              f"{result['p2p_gbps']:.0f} GB/s")
    emu = " [EMULATION: not a GPU figure]" if result["context"] == "cpu" else ""
    for t in result["targets"]:
        print(f"# target {t['shard_mib']:g} MiB: {t['target']}: {t['value']:.2f}x "
              f"({'met' if t['met'] else 'NOT met'}; vs {t['vs']}){emu}")


def plot(op, result, path):
    groups = {}
    for r in result["rows"]:
        if "med_ms" in r:
            groups.setdefault(f"{r['shard_mib']:g} MiB", {})[r["path"][:28]] = r["med_ms"]
    common.bar_plot(path, f"tide bench {op}: median latency ({result['label'].split(';')[0]})", groups, "ms")


def main(argv=None, op="ag") -> int:
    ap = argparse.ArgumentParser(prog=f"tide bench {op}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--sizes", default=None, help="shard sizes in MiB (default 32,128; CPU 0.0625,0.25)")
    ap.add_argument("--params", type=int, default=0, help="tensors per group (default 30 AG, 16 RS)")
    ap.add_argument("--ranks", type=int, default=0, help="virtual ranks without >= 2 GPUs (default 8; CPU 4)")
    ap.add_argument("--topologies", default=None, metavar="MxL,...",
                    help="TIDE rows on these node splits of the N ranks (e.g. 1x8,2x4,4x2,8x1)")
    if op == "ag":
        ap.add_argument("--ce-proof", action="store_true", help="copy-engine proof (see ceproof.py)")
        ap.add_argument("--spin-s", type=float, default=2.0, help="--ce-proof: spinner duration")
    args = ap.parse_args(argv)
    if op == "ag" and args.ce_proof:
        from tide_apps.bench import ceproof
        return ceproof.main(args)
    try:
        with common.cpu_threads(args.context):
            result = run(op, args)
    except ValueError as ex:
        print(f"tide bench {op}: error: {ex}", file=sys.stderr)
        return 2
    common.write_json(args.json, result)
    plot(op, result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] in ("ag", "rs") else sys.argv[1:],
                  op=sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("ag", "rs") else "ag"))
