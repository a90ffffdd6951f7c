"""SUM kernel sweep (issue #4): every TIDE_SUM_KERNEL variant x CTA count, on one GPU.

`python -m tide.bench.sum_sweep [--variants vec,vec_l2,bulk] [--entries sum,reduce,land]
[--ctas 1,2,4,8,16,32,66,132] [--terms 8] [--n-big 67108864] [--n-small 2097152] [--json PATH]`

The Level-1 SUM of an L = `terms` node: L - 1 staged bf16 slices + the own bf16 gradient ->
one fp32 node partial, through both entry points: `sum` (launch_sum, the SUM kernel with a
segment table; the layout bench's path) and `reduce` (launch_reduce, the executor's run-table
kernel); `land` is the executor's Level-2 LAND through launch_reduce: L fp32 inbox terms,
dst = dst + alpha * sum (accumulate). Logical bytes per element: 2L read + 4 written (land:
4L + 4 read + 4 written). Figures: ms (median), GB/s, GB/s per
CTA, % of the measured device-to-device ceiling (a 4 GiB copy, read + write). Targets (issue
#4): >= 99 GB/s per CTA at 4, 8 and 16 CTAs and >= 80 % of the ceiling at a full grid, on the
big size. Every variant's output is checked bitwise (same association): sum and reduce against
sum's first variant (same inputs), land against land's first variant.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys

TARGET_PER_CTA = 99.0     # GB/s per CTA at 4, 8 and 16 CTAs
TARGET_CTAS = (4, 8, 16)
TARGET_FULL_GRID = 0.80   # of the ceiling at one CTA per SM


def _time_ms(torch, fn, reps, inner):
    """Median ms per call: `inner` back-to-back calls captured in one CUDA graph, replayed `reps`
    times between events (a small launch runs for ~10 us, less than the Python call that issues
    it; a graph keeps the GPU busy). The first call runs eagerly (one-time setup)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    del graph
    return statistics.median(times)


def _run_table(torch, n, n_terms):
    """One REDUCE run covering [0, n): term i is slot i at byte offset 0 (kernels.h ReduceRun)."""
    rec = struct.pack("<14q16h", 0, n, *([0] * 12), *range(n_terms), *([-1] * (12 - n_terms)), 0, 0, 0, 0)
    return torch.frombuffer(bytearray(rec), dtype=torch.uint8).clone().cuda()


def sweep(torch, core, variants, entries, ctas_list, L, n_big, n_small, ceiling_gbps, n_sm, reps=9,
          bulk_ring=()):
    g = torch.Generator(device="cuda").manual_seed(4)
    staged = [torch.randn(n_big, device="cuda", generator=g).to(torch.bfloat16) for _ in range(L - 1)]
    own = torch.randn(n_big, device="cuda", generator=g).to(torch.bfloat16)
    dst = torch.empty(n_big, device="cuda")
    ptrs = [s.data_ptr() for s in staged]
    inbox, old = [], None
    if "land" in entries:  # L fp32 inbox blocks (the LAND terms) and the accumulated output's start
        inbox = [torch.randn(n_big, device="cuda", generator=g) for _ in range(L)]
        old = torch.randn(n_big, device="cuda", generator=g)
    tables = {n: (torch.tensor([[0, n, 0, 0]], dtype=torch.int64, device="cuda"), _run_table(torch, n, L))
              for n in (n_small, n_big)}

    def launch(entry, n, c):
        seg, runs = tables[n]
        st = torch.cuda.current_stream().cuda_stream  # the capture stream inside torch.cuda.graph
        if entry == "sum":
            core.cuda_sum(dst.data_ptr(), n, ptrs, seg.data_ptr(), 1, [own.data_ptr()], c, st)
        elif entry == "land":
            core.cuda_reduce(dst.data_ptr(), n, runs.data_ptr(), 1, L, (1 << L) - 1, True, True, 0.125,
                             [b.data_ptr() for b in inbox], c, st)
        else:
            core.cuda_reduce(dst.data_ptr(), n, runs.data_ptr(), 1, L, 0, False, False, 1.0,
                             ptrs + [own.data_ptr()], c, st)

    rows, checks, refs, geo = [], [], {}, []
    saved = os.environ.get("TIDE_SUM_KERNEL")
    try:
        for entry in entries:
            for v in variants:
                os.environ["TIDE_SUM_KERNEL"] = v
                ran = core.cuda_sum_kernel()  # the variant actually run (bulk needs sm_90)
                if entry == "land":
                    dst.copy_(old)
                else:
                    dst.fill_(float("nan"))
                launch(entry, n_big, n_sm)
                torch.cuda.synchronize()
                bits = dst.view(torch.int32).clone()
                group = "land" if entry == "land" else "level1"  # sum and reduce: same inputs
                if group not in refs:
                    refs[group] = (f"{entry}/{v}", bits)
                same = bool(torch.equal(bits, refs[group][1]))
                checks.append(dict(entry=entry, variant=v, ran=ran, against=refs[group][0],
                                   bitwise_equal_to_first=same))
                del bits
                for n in (n_small, n_big):
                    logical = n * (4 * L + 8 if entry == "land" else 2 * L + 4)
                    for c in ctas_list:
                        est_ms = logical / min(c * 60e9, 3e12) * 1e3  # ~60 GB/s per CTA, for `inner`
                        inner = max(1, min(50, int(1.0 / max(est_ms, 1e-4))))
                        ms = _time_ms(torch, lambda: launch(entry, n, c), reps, inner)
                        gbps = logical / ms / 1e6
                        rows.append(dict(entry=entry, variant=v, ran=ran, n=n, ctas=c, ms=ms, graph_calls=inner,
                                         gbps=gbps, gbps_per_cta=gbps / min(c, n_sm),
                                         pct_ceiling=100 * gbps / ceiling_gbps))
        # Ring geometry (bulk.cu make_ring): `sum` on the bulk variant with other stage sizes.
        os.environ["TIDE_SUM_KERNEL"] = "bulk"
        if "bulk" in variants and "sum" in entries and core.cuda_sum_kernel() == "bulk":
            for kib, cap in bulk_ring:
                os.environ["TIDE_BULK_STAGE_KIB"] = str(kib)
                os.environ["TIDE_BULK_STAGES"] = str(cap)
                bpe = 2 * L
                chunk = max(8, (kib * 1024 // bpe) // 8 * 8)
                stages = min(cap, (192 << 10) // (chunk * bpe))
                for c in (1, 8):
                    ms = _time_ms(torch, lambda: launch("sum", n_big, c), reps, 1)
                    gbps = n_big * (2 * L + 4) / ms / 1e6
                    geo.append(dict(stage_kib=kib, stages=stages, in_flight_kib=stages * chunk * bpe // 1024,
                                    ctas=c, ms=ms, gbps=gbps, gbps_per_cta=gbps / c))
    finally:
        os.environ.pop("TIDE_BULK_STAGE_KIB", None)
        os.environ.pop("TIDE_BULK_STAGES", None)
        if saved is None:
            os.environ.pop("TIDE_SUM_KERNEL", None)
        else:
            os.environ["TIDE_SUM_KERNEL"] = saved
    del staged, own, dst, inbox, old
    refs.clear()
    torch.cuda.empty_cache()
    return rows, checks, geo


def verdicts(rows, n_big, n_sm):
    out = []
    for key in sorted({(r["entry"], r["variant"]) for r in rows}):
        big = {r["ctas"]: r for r in rows if (r["entry"], r["variant"]) == key and r["n"] == n_big}
        per = {c: big[c]["gbps_per_cta"] for c in TARGET_CTAS if c in big}
        full = big.get(n_sm)
        ok_cta = len(per) == len(TARGET_CTAS) and all(x >= TARGET_PER_CTA for x in per.values())
        ok_full = full is not None and full["pct_ceiling"] >= 100 * TARGET_FULL_GRID
        out.append(dict(entry=key[0], variant=key[1], per_cta=per, full_grid_pct=full and full["pct_ceiling"],
                        meets_per_cta=ok_cta, meets_full_grid=ok_full, meets_both=ok_cta and ok_full))
    return out


def kernel_report(core):
    attrs = core.cuda_sum_kernel_attrs()
    spilled = [a for a in attrs if a["local_bytes"]]
    return attrs, spilled


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tide.bench.sum_sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="vec,vec_l2,bulk")
    ap.add_argument("--entries", default="sum,reduce,land")
    ap.add_argument("--ctas", default="1,2,4,8,16,32,66,132")
    ap.add_argument("--terms", type=int, default=8, help="L: L-1 staged slices + the own gradient")
    ap.add_argument("--n-big", type=int, default=64 << 20, help="elements (fp32 output: 4 bytes each)")
    ap.add_argument("--n-small", type=int, default=2 << 20)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--bulk-ring", default="16,32,64,32x2",
                    help="bulk ring geometries timed for `sum` at 1 and 8 CTAs: KiB per stage, optionally "
                         "xSTAGES (at most that many stages); empty: none")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    from tide import _core as core
    from tide.bench.layout import measure_ceiling
    if not core.cuda_available():
        print("sum_sweep: needs a CUDA GPU and a CUDA build of tide._core", file=sys.stderr)
        return 2
    if not 2 <= args.terms <= 8:
        print(f"sum_sweep: --terms={args.terms}: expected 2..8 (L - 1 <= 7 staged slices)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    n_sm = props.multi_processor_count
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    ceiling = measure_ceiling(torch) / 1e9
    attrs, spilled = kernel_report(core)
    variants = args.variants.split(",")
    entries = args.entries.split(",")
    ctas = [int(c) for c in args.ctas.split(",")]
    print(f"# {props.name}, {n_sm} SMs; device-to-device ceiling {ceiling:.0f} GB/s (read+write); "
          f"L = {args.terms}: {args.terms - 1} staged bf16 + own bf16 -> fp32, {2 * args.terms + 4} B/element"
          f"{'; land: L fp32 + accumulate -> fp32, %d B/element' % (4 * args.terms + 8) if 'land' in entries else ''}")
    print(f"# kernels: {len(attrs)}; with local memory (spills/stack): "
          f"{', '.join(a['name'] for a in spilled) if spilled else 'none'}")
    for a in attrs:
        if a["name"].startswith(("sum_kernel<7>", "reduce_kernel<8>", "reduce_kernel<8,fp32>", "sum_bulk_kernel<7>", "reduce_bulk_kernel<8>")):
            print(f"#   {a['name']:24} {a['regs']:4d} regs, {a['local_bytes']} B local, "
                  f"{a['static_smem']} B static smem")
    bulk_ring = [(int(g.split("x")[0]), int(g.split("x")[1]) if "x" in g else 16)
                 for g in args.bulk_ring.split(",") if g]
    rows, checks, geo = sweep(torch, core, variants, entries, ctas, args.terms, args.n_big, args.n_small, ceiling,
                              n_sm, reps=args.reps, bulk_ring=bulk_ring)
    print(f"{'entry':7} {'variant':7} {'ran':7} {'n':>10} {'ctas':>5} {'ms':>9} {'GB/s':>8} {'GB/s/CTA':>9} "
          f"{'%ceil':>6}")
    for r in rows:
        print(f"{r['entry']:7} {r['variant']:7} {r['ran']:7} {r['n']:10d} {r['ctas']:5d} {r['ms']:9.4f} "
              f"{r['gbps']:8.0f} {r['gbps_per_cta']:9.1f} {r['pct_ceiling']:6.1f}")
    for c in checks:
        print(f"# bitwise {c['entry']}/{c['variant']} (ran {c['ran']}) == {c['against']}: "
              f"{c['bitwise_equal_to_first']}")
    for r in geo:  # at a fixed ring: rate ~ stage size -> per-chunk cost; ~ bytes in flight -> latency
        print(f"# bulk ring: sum, {r['stage_kib']:3d} KiB x {r['stages']:2d} stages ({r['in_flight_kib']} KiB), "
              f"{r['ctas']} CTAs: {r['ms']:.4f} ms, {r['gbps_per_cta']:.1f} GB/s per CTA")
    vs = verdicts(rows, args.n_big, n_sm)
    for v in vs:
        per = "/".join(f"{v['per_cta'].get(c, float('nan')):.0f}" for c in TARGET_CTAS)
        full = v["full_grid_pct"]
        print(f"# target {v['entry']}/{v['variant']}: GB/s per CTA at {'/'.join(map(str, TARGET_CTAS))} = {per} "
              f"(>= {TARGET_PER_CTA:.0f}: {'PASS' if v['meets_per_cta'] else 'FAIL'}); full grid "
              f"{'n/a' if full is None else f'{full:.1f}%'} (>= {100 * TARGET_FULL_GRID:.0f}%: "
              f"{'PASS' if v['meets_full_grid'] else 'FAIL'})")
    winners = [f"{v['entry']}/{v['variant']}" for v in vs if v["meets_both"]]
    print(f"# variants meeting both targets: {', '.join(winners) if winners else 'none'}")
    ok_bits = all(c["bitwise_equal_to_first"] for c in checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, sms=n_sm, ceiling_gbps=ceiling, terms=args.terms, rows=rows,
                           checks=checks, verdicts=vs, kernel_attrs=attrs, spilled=spilled, bulk_ring=geo), f,
                      indent=1)
    return 0 if ok_bits and not spilled else 1


if __name__ == "__main__":
    sys.exit(main())
