"""Where the 70B RS chain's time above its byte floor goes, on one GPU (issue #4).

Each row times one step of the chain (or a variant of it) at the 70B group's sizes and prints
ms and ms / floor (bytes moved over the measured copy ceiling):
  land   LAND's bytes (one fp32 source -> fp32 out, alpha): torch's mul, then cuda_land at
         several grids (a CTA per tile; one resident wave and 2-32 waves looping over tiles) and
         forms, and the executors' REDUCE on the same data;
  sum    SUM's bytes (7 staged bf16 + own bf16 -> fp32): cuda_sum at several grids, REDUCE;
  copy   the staging's bytes: the plan's own 2-D descriptors, per copy, as rows, contiguous,
         and synthetic 2-D shapes of the same bytes (height 8 / 64 / 512, pitched or not);
  both   the staging and an independent SUM on two streams at once against each alone.
Run on the GPU machine after a CUDA build: `PYTHONPATH=. python tools/gpu/rsdiag.py`.
"""
from __future__ import annotations

import statistics
import sys


def main() -> int:
    import torch
    import tide
    from tide import _core as core, models
    from tide.bench.common import time_cuda
    from tide.bench.layout import GROUPS, measure_ceiling, pack_reduce_runs, with_env as env

    if not core.cuda_available():
        print("rsdiag: needs a CUDA GPU and a CUDA build", file=sys.stderr)
        return 2
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    bench_stream = torch.cuda.Stream()
    torch.cuda.set_stream(bench_stream)
    st = bench_stream.cuda_stream
    ceiling = measure_ceiling(torch)
    rows = []

    def row(kind, label, fn, nbytes, reps=10):
        times = time_cuda(torch, fn, reps, 3)
        ms = statistics.median(times)
        floor = nbytes / ceiling * 1e3
        rows.append((kind, label, ms, ms / floor))
        print(f"{kind:5} {label:58} {ms:8.3f} {ms / floor:6.2f}", flush=True)

    L = 8
    plan = tide.plan(models.signature(GROUPS["llama70b"], "block"), tide.Topology(1, L))
    e_sub = plan.rs_schedule.E_sub
    n = L * e_sub
    alpha = 1.0 / L
    print(f"# {torch.cuda.get_device_name(0)}, {n_sm} SMs, ceiling {ceiling / 1e9:.0f} GB/s; 70B: n = {n}")

    # ---- LAND: one source, overwrite ----
    src = torch.randn(n, device="cuda")
    dst = torch.empty(n, device="cuda")
    land_b = 8 * n
    row("land", "torch mul (reference)", lambda: torch.mul(src, alpha, out=dst), land_b)
    row("land", "torch copy_ (reference)", lambda: dst.copy_(src), land_b)
    job = [(dst.data_ptr(), [src.data_ptr()], n)]
    tile = 16 * 512 * 4
    row("land", f"cuda_land {n_sm} CTAs (default: a CTA per tile)",
        lambda: core.cuda_land(job, alpha, False, n_sm, st), land_b)
    for c in (n_sm, 2 * n_sm, 4 * n_sm, 8 * n_sm, 16 * n_sm, (n + tile - 1) // tile):
        row("land", f"cuda_land {c} CTAs (TIDE_FULL_GRID=wave: the grid as given)",
            env("TIDE_FULL_GRID", "wave", lambda c=c: core.cuda_land(job, alpha, False, c, st)), land_b)
    row("land", f"cuda_land {n_sm} CTAs, 8 vectors (TIDE_LAND_DEEP=0), a CTA per tile",
        env("TIDE_LAND_DEEP", "0", lambda: core.cuda_land(job, alpha, False, n_sm, st)), land_b)
    row("land", f"cuda_land {n_sm} CTAs, ranges",
        env("TIDE_CTA_SPLIT", "ranges", lambda: core.cuda_land(job, alpha, False, n_sm, st)), land_b)
    red_land = pack_reduce_runs(torch, [(0, n, [(0, 0)])], "cuda")
    lfull = n_sm * max(1, core.cuda_resident_ctas_per_sm("reduce_fp32", 1))

    def exec_land(c):
        core.cuda_reduce(dst.data_ptr(), n, red_land.data_ptr(), 1, 1, 1, True, False, alpha, [src.data_ptr()], c, st)
    row("land", f"REDUCE {lfull} CTAs (a CTA per tile)", lambda: exec_land(lfull), land_b)
    row("land", f"REDUCE {lfull} CTAs, one wave", env("TIDE_FULL_GRID", "wave", lambda: exec_land(lfull)), land_b)
    del src, dst

    # ---- SUM: 7 staged bf16 + own bf16 -> fp32 ----
    staged = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(L - 1)]
    own = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.empty(n, device="cuda")
    seg = torch.tensor([[0, n, 0, 0]], dtype=torch.int64, device="cuda")
    sum_b = 2 * L * n + 4 * n
    sptr = [s.data_ptr() for s in staged]

    def tide_sum(c, stream=st):
        core.cuda_sum(out.data_ptr(), n, sptr, seg.data_ptr(), 1, [own.data_ptr()], c, stream)

    full = n_sm * max(1, core.cuda_resident_ctas_per_sm("sum", L - 1))
    row("sum", f"cuda_sum {full} CTAs (default: a CTA per tile)", lambda: tide_sum(full), sum_b)
    for c in sorted({full, 2 * full, 4 * full, 8 * full}):
        row("sum", f"cuda_sum {c} CTAs (TIDE_FULL_GRID=wave)", env("TIDE_FULL_GRID", "wave", lambda c=c: tide_sum(c)),
            sum_b)
    row("sum", f"cuda_sum {full} CTAs, ranges", env("TIDE_CTA_SPLIT", "ranges", lambda: tide_sum(full)), sum_b)
    # The executors' REDUCE on the same data: one run of 8 bf16 terms (7 staged + own).
    red_sum = pack_reduce_runs(torch, [(0, n, [(j, 0) for j in range(L)])], "cuda")
    red_bases = sptr + [own.data_ptr()]
    rfull = n_sm * max(1, core.cuda_resident_ctas_per_sm("reduce", L))

    def exec_sum(c):
        core.cuda_reduce(out.data_ptr(), n, red_sum.data_ptr(), 1, L, 0, False, False, 1.0, red_bases, c, st)
    row("sum", f"REDUCE {rfull} CTAs (a CTA per tile)", lambda: exec_sum(rfull), sum_b)
    row("sum", f"REDUCE {rfull} CTAs, one wave", env("TIDE_FULL_GRID", "wave", lambda: exec_sum(rfull)), sum_b)
    acc = torch.empty(n, device="cuda")
    row("sum", "torch: 8 bf16 adds into fp32 (reference, more bytes)",
        lambda: (torch.add(staged[0], staged[1], out=acc), [acc.add_(s) for s in staged[2:]], acc.add_(own)),
        sum_b)
    del acc

    # ---- staging copies: the plan's geometry and same-byte shapes ----
    shapes = [tuple(s) for s in core.plan_shapes(plan)]
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = {u: [torch.randn(*shapes[p], device="cuda", generator=g).to(torch.bfloat16) for p in range(len(shapes))]
             for u in range(1, L)}
    staging = torch.zeros(L - 1, L * e_sub, dtype=torch.bfloat16, device="cuda")
    copies = []
    for slot, u in enumerate(range(1, L)):
        for c in core.rs_level1_copies(plan, u):
            if c["owner"] == 0 and c["s"] == 0:
                copies.append((staging[slot].data_ptr() + c["dst_offset"], grads[u][c["param"]].data_ptr() + c["src_offset"],
                               c["width"], c["height"], c["dst_pitch"], c["src_pitch"]))
    stage_b = sum(2 * w * h for _, _, w, h, _, _ in copies)
    print(f"# staging: {len(copies)} copies, widths {sorted({w for _, _, w, _, _, _ in copies})}, "
          f"heights {sorted({h for _, _, _, h, _, _ in copies})}")
    lanes = core.cuda_copy_lanes()
    for ln in sorted({1, lanes, 8}):
        row("copy", f"plan 2-D batch, {ln} lane(s)", lambda ln=ln: core.cuda_copies(copies, st, ln), stage_b)
    row("copy", f"plan 2-D per copy, {lanes} lane(s)",
        env("TIDE_COPY_2D", "per_copy", lambda: core.cuda_copies(copies, st, lanes)), stage_b)
    # Same bytes, contiguous, one descriptor per peer (what a flat copy costs).
    per_peer = stage_b // 2 // (L - 1)
    flat_src = torch.empty(stage_b // 2 // 2, dtype=torch.bfloat16, device="cuda")
    flat = [(staging[j].data_ptr(), flat_src.data_ptr() + j * per_peer, per_peer, 1, per_peer, per_peer)
            for j in range(L - 1)]
    row("copy", f"7 contiguous 1-D copies, {lanes} lane(s)", lambda: core.cuda_copies(flat, st, lanes), stage_b)
    # Synthetic 2-D: the same bytes per peer as height h rows of width per_peer / h; pitch = width
    # (dense) or width + 4 KiB (strided) on the destination.
    for h in (8, 64, 512):
        w = per_peer // h // 256 * 256
        for gap in (0, 4096):
            if (w + gap) * h > staging.shape[1] * 2:
                continue
            d = [(staging[j].data_ptr(), flat_src.data_ptr() + j * per_peer, w, h, w + gap, w) for j in range(L - 1)]
            row("copy", f"synthetic 2-D h={h} w={w >> 10} KiB dpitch=w+{gap}, {lanes} lane(s)",
                lambda d=d: core.cuda_copies(d, st, lanes), 2 * w * h * (L - 1))
    del flat_src

    # ---- staging and SUM at once on two streams ----
    side = torch.cuda.Stream()

    def both():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        core.cuda_copies(copies, st, lanes)
        tide_sum(full, side.cuda_stream)
        cur.wait_stream(side)
    row("both", "staging alone", lambda: core.cuda_copies(copies, st, lanes), stage_b)
    row("both", f"SUM alone ({full} CTAs)", lambda: tide_sum(full), sum_b)
    row("both", "staging || SUM (two streams, independent data)", both, stage_b + sum_b)
    for c in (32, 64):
        def both_c(c=c):
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            core.cuda_copies(copies, st, lanes)
            tide_sum(c, side.cuda_stream)
            cur.wait_stream(side)
        row("both", f"staging || SUM {c} CTAs", both_c, stage_b + sum_b)

    print("\n==== rsdiag summary (ms, x floor) ====")
    for kind, label, ms, x in rows:
        print(f"{kind:5} {label:58} {ms:8.3f} {x:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
