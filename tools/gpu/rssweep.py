"""One RS call's time over plan and executor options, with its timeline's overlap, on one GPU.

`python tools/gpu/rssweep.py [--group llama70b] [--ranks 8] [--reps 7] CASE ...` after a CUDA build
in place (exit 2 without a GPU). One GPU emulates a node (tide.Topology(1, L)), as in rsdiag.py.
A CASE is `plan-options/executor-options`, each a comma list of field=value, e.g.
`n_stg=4/copy_lanes=1` or `/copy_lanes=2` or `chunk_bytes=33554432/`. Per case it prints the call's
median ms and x floor (its programs' bytes over the measured device ceiling) and, with
--timeline, from one profiled call, the share of the call's span in which copies run, kernels
run, both, and neither (idle: waits and launch gaps), and the largest idle gap. Every case's
output is compared bitwise with the first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _kv(text):
    out = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def _union(iv):
    iv = sorted(iv)
    out = []
    for a, b in iv:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(iv):
    return sum(b - a for a, b in iv)


def _intersect(x, y):
    i = j = 0
    out = []
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append([a, b])
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def timeline(torch, fn, dump=None):
    """(span us, copy us, kernel us, both us, largest idle gap us) of one profiled call of fn,
    issued behind a spin kernel that outlasts its host enqueue (the spin is left out);
    dump: a path to write the call's GPU events to ([stream, start us, dur us, kind, name])."""
    from tide_apps.bench.layout import trace_events
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    evs = trace_events(torch, fn, gate_ms=(time.perf_counter() - t) * 1e3)
    cp, kn, events = [], [], []
    for ev in evs:
        cat = ev.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy") or "spin" in ev.get("name", "") or "sleep" in ev.get("name", ""):
            continue
        a = float(ev["ts"])
        (cp if cat == "gpu_memcpy" else kn).append([a, a + float(ev.get("dur", 0))])
        if dump is not None:
            events.append([ev.get("tid"), a, float(ev.get("dur", 0)), cat, ev.get("name", "")[:40]])
    if dump is not None:
        t0 = min((e[1] for e in events), default=0.0)
        with open(dump, "w") as f:
            json.dump([[e[0], round(e[1] - t0, 1), round(e[2], 1), e[3], e[4]] for e in events], f)
    cu, ku = _union(cp), _union(kn)
    every = _union(cu + ku)
    if not every:
        return 0, 0, 0, 0, 0
    span = every[-1][1] - every[0][0]
    gap = max([b[0] - a[1] for a, b in zip(every, every[1:])] or [0.0])
    return span, _length(cu), _length(ku), _length(_intersect(cu, ku)), gap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu/rssweep.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", default="llama70b")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--trace", default=None, help="write each case's GPU events to TRACE.<i>.json (implies --timeline)")
    ap.add_argument("--timeline", action="store_true",
                    help="profile one call per case for the overlap columns; the profiler slows every later case "
                         "(tide_apps/bench/layout.py), so compare the ms of profiled cases only with each other")
    ap.add_argument("cases", nargs="*", default=["/"])
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    import tide
    from tide import _core as core, models
    from tide_apps.bench.layout import GROUPS, _call_ms, _release, measure_ceiling, program_bytes

    if not core.cuda.available():
        print("rssweep: needs a CUDA GPU and a CUDA build of tide._core", file=sys.stderr)
        return 2
    torch.cuda.set_stream(torch.cuda.Stream())
    ceiling = measure_ceiling(torch)
    L = args.ranks
    sig = models.signature(GROUPS[args.group], "block")
    base = tide.plan(sig, tide.Topology(1, L))
    shapes = [tuple(s) for s in core.plan_shapes(base)]
    g = torch.Generator(device="cuda").manual_seed(2)
    grads = [[torch.randint(-4, 5, s, device="cuda", generator=g).to(torch.bfloat16) for s in shapes]
             for _ in range(L)]
    print(f"# {torch.cuda.get_device_name(0)}, ceiling {ceiling / 1e9:.0f} GB/s, {args.group} 1 x {L}, "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}")
    print(f"{'case':44} {'n_stg':>5} {'chunkMB':>7} {'sum':>4} {'ms':>8} {'xfl':>5} "
          f"{'copy%':>6} {'kern%':>6} {'both%':>6} {'idle%':>6} {'gap_us':>7} ok")
    first, ok_all = None, True
    for ci, case in enumerate(args.cases):
        popt, _, eopt = case.partition("/")
        plan = tide.plan(sig, tide.Topology(1, L), **_kv(popt))
        vc = tide.VirtualCluster(tide.Topology(1, L), backend="cuda", check=False,
                                 options=tide.ExecutorOptions(**_kv(eopt)))
        outs, go = vc.reduce_scatter_runner(plan, grads, scale=1.0 / L)
        s, ex = vc.session(plan, "reduce_scatter")
        ps = s.programs("reduce_scatter", 1, 1.0 / L, False)
        floor_ms = program_bytes(core, ps, L) / ceiling * 1e3
        ms, _, _ = _call_ms(torch, go.enqueue, ex.synchronize, args.reps)
        span = c = k = b = gap = 0
        if args.timeline or args.trace:
            span, c, k, b, gap = timeline(torch, lambda: (go.enqueue(), ex.synchronize()),
                                          f"{args.trace}.{ci}.json" if args.trace else None)
        if first is None:
            first, ok = [o.clone() for o in outs], True
        else:
            ok = all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(first, outs))
        ok_all &= ok
        pct = lambda v: 100.0 * v / span if span else 0.0  # noqa: E731
        idle = span - (c + k - b)
        chunk_mb = plan.rs["E_chunk"] * 2 / 2**20
        print(f"{case:44} {plan.options['n_stg']:5d} {chunk_mb:7.1f} {s.sum_ctas:4d} "
              f"{ms:8.3f} {ms / floor_ms:5.2f} {pct(c):6.1f} {pct(k):6.1f} {pct(b):6.1f} {pct(idle):6.1f} "
              f"{gap:7.0f} {ok}", flush=True)
        del vc, go, outs, s, ex
        _release(torch)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
