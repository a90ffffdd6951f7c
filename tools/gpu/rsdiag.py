"""Where an RS call's time above its byte floor goes, on one GPU: the parts of the programs that run.

`python tools/gpu/rsdiag.py [--group llama70b] [--ranks 8] [--reps 10] [--json PATH]` after a CUDA
build in place (exit 2 without a GPU). One GPU emulates a node (tide.Topology(1, L));
the programs are the group's TIDE-RS programs as the 1 x L CUDA VirtualCluster's session builds
them. Each row prints ms and x floor (its bytes over the measured device-to-device ceiling):
  sum   rank 0's SUM op(s) on the run table the CUDA executor builds (tide._core.testing.run_table,
        packed by cuda.reduce_runs): as the executors launch it (kernels.cu's SUM for an op in the
        Level-1 shape, else REDUCE) and as REDUCE on the same table, at the solver's budget and a
        full grid (SMs x resident CTAs), at the full grid under ExecutorOptions(cta_split='ranges')
        and (full_grid='wave') (tide_apps.bench.layout.ReduceOp binds the table's slots to buffers)
  land  rank 0's LAND ops (REDUCE on their run tables) in program order, the same budgets / options
  copy  rank 0's Level-1 pushes (tide._core.rs_level1_copies: the descriptors of its COPY ops, one
        submission per owner as the executor issues one COPY op per owner; each owner's staging
        area a buffer of its own) on the copy engines under copy_lanes 1 / default / 8 x copy_2d
        batch / per_copy, and on SMs (TIDE's copy kernel, copies_on=sms) at 8 / 16 / default / 64 CTAs
  ref   torch's copy_ of the SUM's bytes (contiguous): what a plain kernel reaches at this size
  call  the whole reduce_scatter call of the virtual cluster (every rank, every op: staging, SUM,
        ZERO, the rail's copies, LAND) at the solver's budgets (copies_on auto: the pushes between
        ranks of this one GPU on SMs; and copies_on=copy_engines), a full grid, and the full grid
        under ranges / wave; under the table, the full-grid call's GPU time by kernel and copies
Bytes: an op's run table (every present term read, the fp32 destination written), a copy's width
x height read and written, a call's every COPY / PUT descriptor and run table over all ranks (ZERO
ops carry no size in the listings: their time is time above the floor). ms: the median device time;
a call's host enqueue is kept off the clock (tide_apps.bench.layout._call_ms). Checks: a Level-1 SUM
gives REDUCE's bits on the same table, and every call variant gives the first one's bits.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu/rsdiag.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", default="llama70b", help="a group of tide_apps.bench.layout.GROUPS")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="the full-grid call's time by kernel (the profiler "
                    "slows every later call: tide_apps/bench/layout.py)")
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repo's tide
    import torch

    import tide
    from tide import _core as core, models
    from tide_apps.bench.common import time_cuda
    from tide_apps.bench.layout import (GROUPS, ReduceOp, _call_ms, _profile_parts, _release, full_grid,
                                   level1_matches_reduce, measure_ceiling, program_bytes, reduce_ops)

    if args.group not in GROUPS:
        ap.error(f"--group: expected one of {', '.join(GROUPS)}, got {args.group!r}")
    if not core.cuda.available():
        print("rsdiag: needs a CUDA GPU and a CUDA build of tide._core", file=sys.stderr)
        return 2
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    torch.cuda.set_stream(torch.cuda.Stream())  # cudaMemcpyBatchAsync needs a real stream
    st = torch.cuda.current_stream().cuda_stream
    ceiling = measure_ceiling(torch)
    rows = []

    def row(kind, label, nbytes, ms):
        x = ms / (nbytes / ceiling * 1e3)
        rows.append(dict(kind=kind, label=label, ms=ms, bytes=nbytes, x_floor=x))
        print(f"{kind:5} {label:64} {ms:8.3f} {x:6.2f}", flush=True)

    def timed(kind, label, fn, nbytes):
        row(kind, label, nbytes, statistics.median(time_cuda(torch, fn, args.reps, 3)))

    L = args.ranks
    alpha = 1.0 / L
    plan = tide.plan(models.signature(GROUPS[args.group], "block"), tide.Topology(1, L))
    shapes = [tuple(s) for s in core.plan_shapes(plan)]
    g = torch.Generator(device="cuda").manual_seed(2)
    grads = [[torch.randint(-4, 5, s, device="cuda", generator=g).to(torch.bfloat16) for s in shapes]
             for _ in range(L)]
    default = tide.ExecutorOptions()
    print(f"# {torch.cuda.get_device_name(0)}, {n_sm} SMs, ceiling {ceiling / 1e9:.0f} GB/s; {args.group} on "
          f"1 x {L}: E = {plan.layout.E}; solver SUM {plan.solver['sum_ctas']} / LAND {plan.solver['land_ctas']} "
          f"CTAs; executor options {default.effective()}")

    # ---- the whole call, per variant (the first one's session gives the programs below) ----
    ps, first, calls = None, None, {}
    same_bits = True
    variants = [("solver budgets", {}, False),
                ("solver budgets, copies on copy engines", dict(copies_on="copy_engines"), False),
                ("full grid, CTA ranges", dict(cta_split="ranges"), True),
                ("full grid, one wave", dict(full_grid="wave"), True), ("full grid", {}, True)]
    for label, opts, full in variants:
        vc = tide.VirtualCluster(tide.Topology(1, L), backend="cuda", check=False,
                                 options=tide.ExecutorOptions(**opts), sum_ctas=calls["sum_full"] if full else None,
                                 land_ctas=calls["land_full"] if full else None)
        outs, go = vc.reduce_scatter_runner(plan, grads, scale=alpha)
        s, ex = vc.session(plan, "reduce_scatter")
        if ps is None:
            ps = s.programs("reduce_scatter", 1, alpha, False)
            ops = reduce_ops(core, ps, 0)
            calls.update(sum_full=full_grid(core, ops, "SUM", n_sm), land_full=full_grid(core, ops, "LAND", n_sm),
                         bytes=program_bytes(core, ps, L))
            first = [o.clone() for o in outs]
        else:
            same_bits = same_bits and all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                          for a, b in zip(first, outs))
        ms, _, enq = _call_ms(torch, go.enqueue, ex.synchronize, args.reps)
        parts = _profile_parts(torch, go, n_sm)[3] if args.profile else {}
        calls[label] = dict(ms=ms, enqueue_ms=enq, parts=parts, sum_ctas=s.sum_ctas, land_ctas=s.land_ctas)
        row("call", f"reduce_scatter, {label} (SUM {s.sum_ctas} / LAND {s.land_ctas} CTAs)", calls["bytes"], ms)
        del vc, go, outs, s, ex
        _release(torch)
    del first

    # ---- rank 0's SUM and LAND ops on their run tables ----
    sums = [ReduceOp(torch, core, o, grads=grads[0]) for o in ops if o["kind"] == "SUM"]
    lands = [ReduceOp(torch, core, o, alpha=alpha) for o in ops if o["kind"] == "LAND"]
    budgets = {"SUM": plan.solver["sum_ctas"], "LAND": plan.solver["land_ctas"]}
    for kind, group in (("sum", sums), ("land", lands)):
        if not group:
            continue
        nbytes = sum(o.bytes for o in group)
        what = (f"{kind.upper()} op {group[0].op}" if len(group) == 1 else
                f"{len(group)} {kind.upper()} ops {group[0].op}-{group[-1].op}")
        full = full_grid(core, ops, kind.upper(), n_sm)
        cases = [(f"solver budget, {budgets[kind.upper()]} CTAs", budgets[kind.upper()], None, False),
                 (f"full grid, {full} CTAs", full, None, False),
                 ("full grid, CTA ranges", full, dict(cta_split="ranges"), False),
                 ("full grid, one wave", full, dict(full_grid="wave"), False)]
        if any(o.level1 is not None for o in group):
            rfull = full_grid(core, ops, kind.upper(), n_sm, reduce=True)
            cases += [(f"REDUCE on the table, full grid, {rfull} CTAs", rfull, None, True),
                      ("REDUCE on the table, full grid, one wave", rfull, dict(full_grid="wave"), True)]
        for label, ctas, opts, red in cases:
            timed(kind, f"{what} on {group[0].runs_on(red)}, {label}",
                  lambda c=ctas, o=opts, r=red: [x.launch(c, st, o, reduce=r) for x in group], nbytes)
    level1_ok = level1_matches_reduce(torch, sums, full_grid(core, ops, "SUM", n_sm), st)
    sum_bytes = sum(o.bytes for o in sums)
    del sums, lands
    _release(torch)

    # ---- rank 0's Level-1 pushes ----
    owners = {}
    for c in core.rs_level1_copies(plan, 0):
        owners.setdefault(c["owner"], []).append(c)
    dsts, subs = [], []
    for cs in owners.values():
        end = max(c["dst_offset"] + (c["height"] - 1) * c["dst_pitch"] + c["width"] for c in cs)
        dst = torch.empty(end, dtype=torch.uint8, device="cuda")
        dsts.append(dst)
        subs.append([(dst.data_ptr() + c["dst_offset"], grads[0][c["param"]].data_ptr() + c["src_offset"],
                      c["width"], c["height"], c["dst_pitch"], c["src_pitch"]) for c in cs])
    stage_b = sum(2 * w * h for sub in subs for _, _, w, h, _, _ in sub)
    print(f"# rank 0's pushes: {sum(map(len, subs))} descriptors in {len(subs)} COPY ops, widths "
          f"{sorted({d[2] for sub in subs for d in sub})}, heights {sorted({d[3] for sub in subs for d in sub})}")
    for c2 in ("batch", "per_copy"):
        for ln in sorted({1, default.copy_lanes, 8}):
            timed("copy", f"{len(subs)} COPY ops, copy_2d {c2}, {ln} lane(s)",
                  lambda ln=ln, c2=c2: [core.cuda.copies(sub, st, ln, c2) for sub in subs], stage_b)
    for ctas in sorted({8, 16, default.copy_ctas, 64}):
        timed("copy", f"{len(subs)} COPY ops on SMs (copies_on=sms), {ctas} CTAs",
              lambda ctas=ctas: [core.cuda.copies(sub, st, sm_ctas=ctas) for sub in subs], stage_b)
    del dsts, subs

    # ---- a plain kernel on the SUM's bytes ----
    a = torch.empty(sum_bytes // 4, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    timed("ref", "torch copy_, the SUM ops' bytes (contiguous)", lambda: b.copy_(a), sum_bytes)
    del a, b, grads
    _release(torch)

    fg = calls["full grid"]
    print(f"# full-grid call ({fg['sum_ctas']} / {fg['land_ctas']} CTAs), GPU time by kernel (summed over "
          f"every rank's streams, which overlap), host enqueue {fg['enqueue_ms']:.2f} ms:")
    for k, v in sorted(fg["parts"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"#   {k:28} {v['count']:5d}x {v['ms']:9.3f} ms {v['sm_ms']:9.2f} SM*ms")
    print(f"# checks: Level-1 SUM = REDUCE bitwise: {level1_ok}; call variants bitwise equal: {same_bits}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(group=args.group, ranks=L, ceiling_gbps=ceiling / 1e9, rows=rows, calls=calls,
                           level1_matches_reduce=level1_ok, call_variants_bitwise=same_bits), f, indent=1)
    print("\n==== rsdiag summary (ms, x floor) ====")
    order = ("sum", "land", "copy", "ref", "call")  # the full-grid call last
    for r in sorted(rows, key=lambda r: order.index(r["kind"])):
        print(f"{r['kind']:5} {r['label']:64} {r['ms']:8.3f} {r['x_floor']:6.2f}")
    return 0 if level1_ok and same_bits else 1


if __name__ == "__main__":
    sys.exit(main())
