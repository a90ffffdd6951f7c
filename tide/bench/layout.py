"""Layout bench: FSDP2's stock layout path against TIDE's layout work, on one GPU.

`python -m tide.bench.layout [--groups llama70b,qwen3,wan22] [--json PATH]` (later `tide bench
layout`). One GPU emulates the per-GPU HBM work of rank 0 in an N = 8 (M = 1, L = 8) node:

  AG  stock: rank-major all-gather output (one NS copy) + torch.split_with_sizes_copy (2NS)
      TIDE : direct landing, one strided 2-D copy per parameter (or a batch of N*P 1-D copies)
  RS  stock: torch._chunk_cat pack to fp32 (NS read + 2NS write) + packed fp32 reduce of the
             rank's chunk over N ranks (2NS read + 2S write)
      TIDE : copy-engine staging of the L-1 peers' bf16 sub-slice rows (strided, height L),
             SUM (L-1 staged + own per-parameter gradient -> fp32 block), LAND (alpha, into the
             fp32 shard).
TIDE's copies run as the executors issue them: spread over copy lanes (TIDE_COPY_LANES; rows per
lane count), strided copies in one 2-D batch (rows with TIDE_COPY_2D=per_copy beside them). The
chunked RS rows stage K chunks of L/K block rows, chunk k+1's copies overlapping SUM + LAND of
chunk k on a second stream under a CTA budget, at most n_stg chunks ahead (paper §4.1, staging
"processed and reused in chunks"); the executors' RS program does not overlap them yet (a rank's
pushes and SUMs share its read stream). SUM and LAND split their elements in tiles
(TIDE_CTA_SPLIT; rows with contiguous per-CTA ranges beside them); a full-grid budget runs one
short-lived CTA per tile ("one wave" rows: TIDE_FULL_GRID=wave, the budget's CTAs looping).
SUM and LAND rows time kernels.cu's kernels; "REDUCE" rows time reduce.cu's run-table kernel on
the same data. The "executor" chain is what both CUDA executors run: LAND on REDUCE, and a SUM of
the Level-1 shape (staged slices + own gradient, checked on the plan's own RS program) on
kernels.cu's SUM, any other SUM on REDUCE. "ref:" rows are torch's
own kernels on the same bytes (a contiguous copy, a scale), what a plain kernel reaches at this
size. Every RS result (one piece, chunked, executor, REDUCE only) is checked bit for bit against a torch
reference in the fixed association.
On one GPU every copy is a same-device copy, which the driver runs on SMs; between GPUs the
same descriptors run on copy engines. Bytes are HBM bytes (read + write) of the step.
Peers' buffers live on the same GPU, so "peer" reads are local reads here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from types import SimpleNamespace

# Bench names -> built-in models (tide/models.py holds the shapes and cites their configs).
GROUPS = {"llama70b": "llama3.1-70b", "qwen3": "qwen3-30b-a3b", "wan22": "wan2.2-14b"}


def _layout(plan):
    """The plan's per-parameter layout (paper §2.1) as lists: D, K, R, e_p = R_p*K_p, o = o32_p."""
    ps = plan.layout.params
    return SimpleNamespace(D=[p.D for p in ps], K=[p.K for p in ps], R=[p.R for p in ps],
                           e=[p.e for p in ps], o=[p.o32 for p in ps], E=plan.layout.E)


def _median_ms(torch, fn, reps=10, warmup=3):
    from tide.bench.common import time_cuda
    times = time_cuda(torch, fn, reps, warmup)
    return statistics.median(times), (min(times), max(times))


def _profile(torch, fn, n_sm):
    """Kernel count, copy count and SM*ms of one call (SMs of a kernel = min(CTAs, SMs))."""
    if os.environ.get("TIDE_BENCH_NO_PROFILE") == "1":
        return 0, 0, 0.0
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    kernels = copies = 0
    sm_ms = 0.0
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat", "")
        if cat == "kernel":
            kernels += 1
            g = ev.get("args", {}).get("grid", [1, 1, 1])
            sm_ms += min(g[0] * g[1] * g[2], n_sm) * ev.get("dur", 0) / 1e3
        elif cat == "gpu_memcpy":
            copies += 1
    return kernels, copies, sm_ms


def run_group(torch, core, name, plan, n, ceiling, n_sm, sum_ctas, land_ctas, lanes_list, dev="cuda"):
    # Geometry comes from the plan (one node of n GPUs): layout, E_sub, sub-slice 0 and the
    # Level-1 copies are the ones the RS program issues; nothing is re-derived here.
    L = n
    lay = _layout(plan)
    shapes = [tuple(s) for s in core.plan_shapes(plan)]
    E, P = lay.E, len(shapes)
    S = 2 * E
    st = torch.cuda.current_stream().cuda_stream
    exec_lanes = core.cuda_copy_lanes()  # what the executors spread a large COPY/PUT over
    lanes_list = sorted(set(lanes_list) | {exec_lanes})
    # "Full grid": a budget of every SM's resident CTAs (occupancy API), one wave; the kernels then
    # run one short-lived CTA per tile (kernels.h [Note: full grid]; "one wave" rows: the budget as is).
    sum_full = n_sm * max(1, core.cuda_resident_ctas_per_sm("sum", L - 1))
    land_full = n_sm * max(1, core.cuda_resident_ctas_per_sm("land", 1))  # one source per job here
    # The executors' REDUCE has its own occupancy: its full grid is its own wave.
    exec_sum_full = n_sm * max(1, core.cuda_resident_ctas_per_sm("reduce", L))
    exec_land_full = n_sm * max(1, core.cuda_resident_ctas_per_sm("reduce_fp32", 1))
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []

    # ---------------- AG (rank 0's view) ----------------
    shards = torch.randn(n, E, device=dev, generator=g).to(torch.bfloat16)  # row u: rank u's shard
    ag_out = torch.empty(n * E, dtype=torch.bfloat16, device=dev)
    params = [torch.empty(n * lay.R[p] * lay.K[p], dtype=torch.bfloat16, device=dev) for p in range(P)]
    outs2d = [x.view(n, lay.e[p]) for p, x in enumerate(params)]

    def stock_ag():
        ag_out.copy_(shards.view(-1))  # transport into the rank-major buffer
        torch.split_with_sizes_copy(ag_out.view(n, E), lay.e, dim=1, out=outs2d)

    sp = shards.data_ptr()
    d2 = [(params[p].data_ptr(), sp + 2 * lay.o[p], 2 * lay.e[p], n, 2 * lay.e[p], 2 * E) for p in range(P)]
    d1 = [(params[p].data_ptr() + 2 * u * lay.e[p], sp + 2 * (u * E + lay.o[p]), 2 * lay.e[p], 1, 0, 0)
          for u in range(n) for p in range(P)]

    def tide_ag_2d(lanes=exec_lanes):
        core.cuda_copies(d2, st, lanes)

    def tide_ag_batch(lanes=exec_lanes):
        core.cuda_copies(d1, st, lanes)

    ns = n * S
    ag_steps = [("AG stock: rank-major + split_with_sizes_copy", stock_ag, 4 * ns)]
    for ln in lanes_list:
        ag_steps += [(f"AG TIDE: direct landing, P strided copies, {ln} lane(s)",
                      lambda ln=ln: tide_ag_2d(ln), 2 * ns),
                     (f"AG TIDE: direct landing, P strided copies (2-D per copy), {ln} lane(s)",
                      with_env("TIDE_COPY_2D", "per_copy", lambda ln=ln: tide_ag_2d(ln)), 2 * ns),
                     (f"AG TIDE: direct landing, N*P batched copies, {ln} lane(s)",
                      lambda ln=ln: tide_ag_batch(ln), 2 * ns)]
    for label, fn, nbytes in ag_steps:
        ms, spread = _median_ms(torch, fn)
        k, c, smms = _profile(torch, fn, n_sm)
        rows.append(dict(group=name, step=label, ms=ms, spread=spread, bytes=nbytes,
                         gbps=nbytes / ms / 1e6, floor_ms=nbytes / ceiling * 1e3, kernels=k, copies=c, sm_ms=smms))
    # correctness spot check: TIDE landing equals stock copy-out
    stock_ag()
    ref = [x.clone() for x in params]
    for x in params:
        x.fill_(float("nan"))
    tide_ag_2d()
    torch.cuda.synchronize()
    ag_ok = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(params, ref))
    del shards, ag_out, params, outs2d, ref
    torch.cuda.empty_cache()

    # ---------------- RS (rank 0's GPU) ----------------
    grads = [[torch.randn(*shapes[p], device=dev, generator=g).to(torch.bfloat16) for p in range(P)]
             for _ in range(n)]
    packed_all = torch.empty(n, n, E, dtype=torch.float32, device=dev)
    for u in range(n):
        torch._chunk_cat(grads[u], dim=0, num_chunks=n, out=packed_all[u])
    out0 = torch.empty(E, dtype=torch.float32, device=dev)
    alpha = 1.0 / n

    def stock_pack():
        torch._chunk_cat(grads[0], dim=0, num_chunks=n, out=packed_all[0])

    def stock_reduce():
        torch.sum(packed_all[:, 0, :], dim=0, out=out0)
        out0.mul_(alpha)

    def stock_rs():
        stock_pack()
        stock_reduce()

    rs = plan.rs_schedule
    e_sub = rs.E_sub
    staging = torch.zeros(L - 1, L * e_sub, dtype=torch.bfloat16, device=dev)
    block = torch.empty(L * e_sub, dtype=torch.float32, device=dev)
    # Rank 0 owns sub-slice 0 of its node (Eq. 7 with j = 0, c = M = 1): its segments are the
    # pieces (p, [a, b)) of each parameter's per-rank chunk, at column sub_offset of a block row.
    sub0 = rs.subslices[0]
    pieces = [(g.param, g.param_offset, g.param_offset + g.length)
              for g in rs.segments[sub0.seg_begin:sub0.seg_end]]
    copies = []
    seg_rows = []
    for i in range(L):
        base = i * e_sub
        pos = 0
        for p, a, b in pieces:
            total = lay.D[p] * lay.K[p]
            lo, hi = i * lay.e[p] + a, i * lay.e[p] + b
            valid = max(0, min(hi, total) - lo)
            dst_off = base + lay.o[p] + a
            if valid:
                seg_rows.append((dst_off, valid, lo, p))
            if valid < b - a:
                seg_rows.append((dst_off + valid, b - a - valid, 0, -1))
            pos = lay.o[p] + b
        if pos < e_sub:
            seg_rows.append((base + pos, e_sub - pos, 0, -1))
    for slot, u in enumerate([u for u in range(n) if u != 0]):
        for c in core.rs_level1_copies(plan, u):  # rank u's pushes into owner 0's staging row
            if c["owner"] != 0 or c["s"] != 0:
                continue
            copies.append((staging[slot].data_ptr() + c["dst_offset"],
                           grads[u][c["param"]].data_ptr() + c["src_offset"],
                           c["width"], c["height"], c["dst_pitch"], c["src_pitch"]))
    seg = torch.tensor([[d, ln, s, p & 0xFFFFFFFF] for d, ln, s, p in seg_rows], dtype=torch.int64, device=dev)
    staged_ptrs = [staging[j].data_ptr() for j in range(L - 1)]
    grad_ptrs = [grads[0][p].data_ptr() for p in range(P)]
    land_jobs = []
    for s in range(L):
        live = max(0, min(E, (s + 1) * e_sub) - s * e_sub)
        if live:
            land_jobs.append((out0.data_ptr() + 4 * s * e_sub, [block.data_ptr() + 4 * s * e_sub], live))

    # What the executors run: REDUCE (reduce.cu, the run-table kernel) for LAND, and for a SUM of
    # the Level-1 shape kernels.cu's SUM (executor.h [Note: Level-1 SUM on kernels.cu's SUM]),
    # read off the plan's own RS program for rank 0. REDUCE rows run the same SUM and LAND as run
    # tables. Slots: 0 .. L-2 the staged slices, L-1 + p rank 0's gradient of parameter p.
    exec_level1 = executor_sum_is_level1(core, plan)
    red_bases = staged_ptrs + grad_ptrs
    red_sum = pack_reduce_runs(torch, [(d, ln, [(j, 2 * d) for j in range(L - 1)] +
                                        [(L - 1 + p, 2 * s_) if p >= 0 else None]) for d, ln, s_, p in sorted(seg_rows)],
                               dev)
    red_land = pack_reduce_runs(torch, [(d0 - out0.data_ptr() >> 2, ln, [(0, 4 * ((d0 - out0.data_ptr()) >> 2))])
                                        for d0, _, ln in land_jobs], dev)
    n_red_sum, n_red_land = red_sum.numel() // 144, red_land.numel() // 144

    def exec_sum(ctas=sum_ctas):
        core.cuda_reduce(block.data_ptr(), L * e_sub, red_sum.data_ptr(), n_red_sum, L, 0, False, False, 1.0,
                         red_bases, ctas, st)

    def exec_land(ctas=land_ctas):
        core.cuda_reduce(out0.data_ptr(), sum(j[2] for j in land_jobs), red_land.data_ptr(), n_red_land, 1, 1, True,
                         False, alpha, [block.data_ptr()], ctas, st)

    def exec_rs(ctas_sum=sum_ctas, ctas_land=land_ctas, level1=exec_level1):
        tide_stage()
        if level1:
            tide_sum(ctas_sum)
        else:
            exec_sum(ctas_sum)
        exec_land(ctas_land)
    exec_full = (sum_full if exec_level1 else exec_sum_full, exec_land_full)

    def tide_stage(lanes=exec_lanes):
        core.cuda_copies(copies, st, lanes)

    def tide_sum(ctas=sum_ctas):
        core.cuda_sum(block.data_ptr(), L * e_sub, staged_ptrs, seg.data_ptr(), len(seg_rows), grad_ptrs, ctas, st)

    def tide_land(ctas=land_ctas):
        for j0 in range(0, len(land_jobs), 16):
            core.cuda_land(land_jobs[j0:j0 + 16], alpha, False, ctas, st)

    def tide_rs():
        tide_stage()
        tide_sum()
        tide_land()

    def tide_rs_full():
        tide_stage()
        tide_sum(sum_full)
        tide_land(land_full)

    # Chunked staging (K pieces of L/K block rows): piece k+1's staging copies run while SUM and
    # LAND of piece k run on a second stream with a CTA budget, and piece k may be staged only once
    # piece k - n_stg was summed (n_stg staging slots, the plan's credit). This is the overlap the
    # paper's chunked staging has ("processed and reused in chunks", §4.1); a SUM with a budget
    # leaves SMs to the copies, which on one GPU are the driver's SM copy kernels.
    side = torch.cuda.Stream()
    n_stg = max(1, plan.options["n_stg"])

    def make_pipeline(K, ctas_sum, ctas_land):
        cuts = [L * k // K for k in range(1, K)]
        parts = row_pieces(copies, [staging[j].data_ptr() for j in range(L - 1)], 2 * e_sub, cuts)
        bounds = [0] + [c * e_sub for c in cuts] + [L * e_sub]
        segs, lands = [], []
        for k in range(K):
            lo, hi = bounds[k], bounds[k + 1]
            segs.append(torch.tensor([[d - lo, ln, s_, p & 0xFFFFFFFF] for d, ln, s_, p in seg_rows if lo <= d < hi],
                                     dtype=torch.int64, device=dev).reshape(-1, 4))
            lands.append([j for s_, j in enumerate(land_jobs) if lo <= s_ * e_sub < hi])
        staged_ev = [torch.cuda.Event() for _ in range(K)]
        summed_ev = [torch.cuda.Event() for _ in range(K)]

        def run():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            for k in range(K):
                if k >= n_stg:  # staging slot k mod n_stg: free once piece k - n_stg was summed
                    cur.wait_event(summed_ev[k - n_stg])
                core.cuda_copies(parts[k], st, exec_lanes)
                staged_ev[k].record(cur)
                side.wait_event(staged_ev[k])
                lo, n_k = bounds[k], bounds[k + 1] - bounds[k]
                core.cuda_sum(block.data_ptr() + 4 * lo, n_k, [q + 2 * lo for q in staged_ptrs], segs[k].data_ptr(),
                              int(segs[k].shape[0]), grad_ptrs, ctas_sum, side.cuda_stream)
                summed_ev[k].record(side)
                if lands[k]:
                    core.cuda_land(lands[k], alpha, False, ctas_land, side.cuda_stream)
            cur.wait_stream(side)
        return run

    pipe_rows = [(K, c) for K in (2, 4, 8) if L % K == 0 for c in sorted({sum_ctas, 48, sum_full})]
    pipelines = {(K, c): make_pipeline(K, c, c if c != sum_full else land_full) for K, c in pipe_rows}

    stage_b = sum(2 * w * h for _, _, w, h, _, _ in copies)  # read + write
    sum_b = (L - 1) * 2 * L * e_sub + 2 * L * e_sub + 4 * L * e_sub
    land_b = 4 * E * 2
    rs_steps = [("RS stock: _chunk_cat bf16 -> fp32 pack", stock_pack, 3 * ns),
                ("RS stock: packed fp32 reduce of the chunk + alpha", stock_reduce, 2 * ns + 2 * S + 2 * 4 * E),
                ("RS stock: _chunk_cat fp32 pack + packed reduce", stock_rs, 3 * ns + 2 * ns + 2 * S + 2 * 4 * E)]
    rs_steps += [(f"RS TIDE: staging copies (strided, height L), {ln} lane(s)", lambda ln=ln: tide_stage(ln), stage_b)
                 for ln in lanes_list]
    rs_steps += [(f"RS TIDE: staging copies (2-D per copy), {ln} lane(s)",
                  with_env("TIDE_COPY_2D", "per_copy", lambda ln=ln: tide_stage(ln)), stage_b) for ln in lanes_list]
    rows_1d = [(d + r * dp, s_ + r * sp, w, 1, 0, 0) for d, s_, w, h, dp, sp in copies for r in range(h)]
    rs_steps += [(f"RS TIDE: staging as {len(rows_1d)} row copies (1-D), {ln} lane(s)",
                  lambda ln=ln: core.cuda_copies(rows_1d, st, ln), stage_b) for ln in sorted({exec_lanes, 8})]
    # Size-matched references (torch's own kernels, no TIDE code): what a plain copy / scale of the
    # same bytes reaches at this size, against the 4 GiB copy that defines the ceiling.
    ref_a = torch.empty(stage_b // 4, dtype=torch.bfloat16, device=dev)
    ref_b = torch.empty_like(ref_a)
    rs_steps += [("ref: torch copy_, staging's bytes (contiguous)", lambda: ref_b.copy_(ref_a), stage_b),
                 ("ref: torch mul, LAND's bytes (block -> shard)", lambda: torch.mul(block[:E], alpha, out=out0), land_b)]
    rs_steps += [(f"RS TIDE: SUM ({sum_ctas} CTAs)", tide_sum, sum_b),
                 (f"RS TIDE: LAND ({land_ctas} CTAs)", tide_land, land_b),
                 (f"RS TIDE: SUM (full grid, {sum_full} CTAs resident)", lambda: tide_sum(sum_full), sum_b),
                 (f"RS TIDE: LAND (full grid, {land_full} CTAs resident)", lambda: tide_land(land_full), land_b),
                 ("RS TIDE: SUM (full grid), CTA ranges", with_env("TIDE_CTA_SPLIT", "ranges", lambda: tide_sum(sum_full)),
                  sum_b),
                 ("RS TIDE: LAND (full grid), CTA ranges",
                  with_env("TIDE_CTA_SPLIT", "ranges", lambda: tide_land(land_full)), land_b),
                 ("RS TIDE: SUM (full grid), vec_l2",
                  with_env("TIDE_SUM_KERNEL", "vec_l2", lambda: tide_sum(sum_full)), sum_b),
                 ("RS TIDE: SUM (full grid), one wave (TIDE_FULL_GRID=wave)",
                  with_env("TIDE_FULL_GRID", "wave", lambda: tide_sum(sum_full)), sum_b),
                 ("RS TIDE: LAND (full grid), one wave (TIDE_FULL_GRID=wave)",
                  with_env("TIDE_FULL_GRID", "wave", lambda: tide_land(land_full)), land_b),
                 ("RS TIDE: LAND (full grid), 8 vectors per thread",
                  with_env("TIDE_LAND_DEEP", "0", lambda: tide_land(land_full)), land_b),
                 (f"RS TIDE: LAND ({land_ctas} CTAs), 8 vectors per thread",
                  with_env("TIDE_LAND_DEEP", "0", tide_land), land_b),
                 ("RS TIDE: staging + SUM + LAND, full grid, SUM vec_l2",
                  with_env("TIDE_SUM_KERNEL", "vec_l2", tide_rs_full), stage_b + sum_b + land_b),
                 ("RS TIDE: staging + SUM + LAND, full grid, CTA ranges",
                  with_env("TIDE_CTA_SPLIT", "ranges", tide_rs_full), stage_b + sum_b + land_b),
                 ("RS TIDE: staging + SUM + LAND, full grid, one wave",
                  with_env("TIDE_FULL_GRID", "wave", tide_rs_full), stage_b + sum_b + land_b),
                 ("RS TIDE: staging + SUM + LAND", tide_rs, stage_b + sum_b + land_b),
                 ("RS TIDE: staging + SUM + LAND, full grid", tide_rs_full, stage_b + sum_b + land_b)]
    rs_steps += [(pipe_label(K, c, sum_full), pipelines[(K, c)], stage_b + sum_b + land_b) for K, c in pipe_rows]
    rs_steps += [(f"RS TIDE REDUCE: SUM ({sum_ctas} CTAs)", exec_sum, sum_b),
                 (f"RS TIDE executor REDUCE: LAND ({land_ctas} CTAs)", exec_land, land_b),
                 (f"RS TIDE REDUCE: SUM (full grid, {exec_sum_full} CTAs resident)",
                  lambda: exec_sum(exec_sum_full), sum_b),
                 (f"RS TIDE executor REDUCE: LAND (full grid, {exec_land_full} CTAs resident)",
                  lambda: exec_land(exec_land_full), land_b),
                 ("RS TIDE executor REDUCE: LAND (full grid), one wave",
                  with_env("TIDE_FULL_GRID", "wave", lambda: exec_land(exec_land_full)), land_b),
                 ("RS TIDE REDUCE only: staging + SUM + LAND, full grid",
                  lambda: exec_rs(exec_sum_full, exec_land_full, False), stage_b + sum_b + land_b),
                 ("RS TIDE executor: staging + SUM + LAND", exec_rs, stage_b + sum_b + land_b),
                 ("RS TIDE executor: staging + SUM + LAND, full grid", lambda: exec_rs(*exec_full),
                  stage_b + sum_b + land_b)]
    for label, fn, nbytes in rs_steps:
        ms, spread = _median_ms(torch, fn)
        k, c, smms = _profile(torch, fn, n_sm)
        rows.append(dict(group=name, step=label, ms=ms, spread=spread, bytes=nbytes,
                         gbps=nbytes / ms / 1e6, floor_ms=nbytes / ceiling * 1e3, kernels=k, copies=c, sm_ms=smms))
    # The one-piece RS against a torch reference in the fixed association (kernels.h: staged slices
    # in slot order, then the own term, then alpha), and every chunked schedule against both.
    ref_out = rs_reference(torch, grads, seg_rows, e_sub, E, alpha)
    out0.fill_(float("nan"))
    tide_rs_full()
    torch.cuda.synchronize()
    ref_ok, ref_diff = bit_diff(torch, ref_out, out0, e_sub)
    out0.fill_(float("nan"))
    exec_rs(*exec_full)
    torch.cuda.synchronize()
    exec_ok, exec_diff = bit_diff(torch, ref_out, out0, e_sub)
    out0.fill_(float("nan"))
    exec_rs(exec_sum_full, exec_land_full, False)
    torch.cuda.synchronize()
    reduce_ok, reduce_diff = bit_diff(torch, ref_out, out0, e_sub)
    pieces_ok, pieces_diff = True, {}
    for (K, c), run in pipelines.items():
        out0.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        ok, diff = bit_diff(torch, ref_out, out0, e_sub)
        pieces_ok = pieces_ok and ok
        if not ok:
            pieces_diff[pipe_label(K, c, sum_full)] = diff
    del grads, packed_all, staging, block, out0, ref_out, red_sum, red_land, ref_a, ref_b
    torch.cuda.empty_cache()
    return rows, dict(group=name, P=P, E=E, S=S, NS=ns, ag_landing_bitwise=ag_ok, rs_reference_bitwise=ref_ok,
                      rs_reference_diff=ref_diff, rs_exec_reference_bitwise=exec_ok, rs_exec_reference_diff=exec_diff,
                      rs_reduce_reference_bitwise=reduce_ok, rs_reduce_reference_diff=reduce_diff,
                      exec_sum_level1=exec_level1,
                      rs_pieces_bitwise=pieces_ok, rs_pieces_diff=pieces_diff,
                      exec_lanes=exec_lanes, sum_full_ctas=sum_full, land_full_ctas=land_full)


def executor_sum_is_level1(core, plan):
    """Whether the executors run every Level-1 SUM of rank 0's RS program as kernels.cu's SUM
    (executor.h [Note: Level-1 SUM on kernels.cu's SUM]): the same host check they make."""
    import re
    ps = core.build_rs_programs(plan, bank=0, alpha=1.0, accumulate=False, expert_lane=False)
    sums = [int(m.group(1)) for line in ps.describe(0) if (m := re.match(r"(\d+) SUM ", line))]
    return bool(sums) and all(core.cuda_run_table(ps, 0, op)[5] is not None for op in sums)


def pack_reduce_runs(torch, runs, dev):
    """ReduceRun records (kernels.h, 144 bytes: int64 dst_off, len, off[12]; int16 slot[12],
    pad[4]) as a uint8 tensor on `dev`; runs are (dst_off, len, terms), terms[i] = (slot, byte
    offset) or None (absent)."""
    import struct
    max_terms = 12
    out = bytearray()
    for d0, ln, terms in runs:
        offs = [t[1] if t else 0 for t in terms] + [0] * (max_terms - len(terms))
        slots = [t[0] if t else -1 for t in terms] + [-1] * (max_terms - len(terms))
        out += struct.pack("<14q16h", d0, ln, *offs, *slots, 0, 0, 0, 0)
    return torch.frombuffer(out, dtype=torch.uint8).clone().to(dev)


def rs_reference(torch, grads, seg_rows, e_sub, E, alpha):
    """Rank 0's RS output as the SUM + LAND chain computes it, from torch ops in the same order:
    for each block segment (dst, len, own offset, param), the L-1 peers' elements in slot order,
    then rank 0's own, each added in fp32, then times alpha. Padding segments (param < 0) read
    only zeroed staging: 0."""
    out = torch.zeros(E, dtype=torch.float32, device=grads[0][0].device)
    for d, ln, s, p in seg_rows:
        if p < 0 or d >= E:
            continue
        ln = min(ln, E - d)
        acc = grads[1][p].view(-1)[s:s + ln].float()
        for u in range(2, len(grads)):
            acc = acc + grads[u][p].view(-1)[s:s + ln].float()
        acc = acc + grads[0][p].view(-1)[s:s + ln].float()
        out[d:d + ln] = acc * alpha
    return out


def bit_diff(torch, want, got, row):
    """(equal bitwise, None or dict(count, first element, its block row, want, got))."""
    ne = want.view(torch.int32) != got.view(torch.int32)
    count = int(ne.sum())
    if count == 0:
        return True, None
    i = int(ne.nonzero()[0, 0])
    return False, dict(count=count, first=i, block_row=i // row, want=float(want[i]), got=float(got[i]))


def with_env(name, value, fn):
    """fn run with the environment variable `name` = value (the knobs are read at every call)."""
    def run():
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            fn()
        finally:
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old
    return run


def pipe_label(K, ctas, full):
    budget = f"full grid, {ctas} CTAs" if ctas == full else f"{ctas} CTAs"
    return f"RS TIDE: staging in {K} chunks overlapping SUM + LAND ({budget})"


def row_pieces(copies, slot_bases, row_bytes, cut_rows):
    """Split staging copies (dst, src, width, height, dpitch, spitch) at the block rows `cut_rows`
    (increasing): piece k holds block rows [cut_rows[k-1], cut_rows[k]). A copy's first block row
    is its offset in its staging slot over `row_bytes` (copies may start at any row: tails); its
    rows are consecutive."""
    cuts = list(cut_rows)
    if any(b <= a for a, b in zip(cuts, cuts[1:])) or (cuts and cuts[0] <= 0):
        raise ValueError(f"cut_rows must be positive and increasing, got {cuts}")
    pieces = [[] for _ in range(len(cuts) + 1)]
    for d, s, w, h, dp, sp in copies:
        base = max(b for b in slot_bases if b <= d)
        r0 = (d - base) // row_bytes
        if h > 1 and dp != row_bytes:
            raise ValueError(f"staging copy at row {r0}: pitch {dp} is not the block row ({row_bytes} bytes)")
        r = 0  # rows of this copy already placed
        for k, end in enumerate(cuts + [None]):
            take = h - r if end is None else min(h - r, max(0, end - (r0 + r)))
            if take:
                pieces[k].append((d + r * dp, s + r * sp, w, take, dp, sp))
                r += take
    return pieces


def sum_sweep(torch, core, L, ctas_list, n_small, n_big, n_sm):
    """SUM rate (logical read + write GB/s) per CTA count, L-1 staged slices + one own segment."""
    dev = "cuda"
    st = torch.cuda.current_stream().cuda_stream
    out = []
    for n in (n_small, n_big):
        staged = [torch.randn(n, device=dev).to(torch.bfloat16) for _ in range(L - 1)]
        own = torch.randn(n, device=dev).to(torch.bfloat16)
        dst = torch.empty(n, device=dev)
        seg = torch.tensor([[0, n, 0, 0]], dtype=torch.int64, device=dev)
        logical = n * (2 * L + 4)
        for c in ctas_list:
            if (n == n_small) != (c <= 24):
                continue
            ms, spread = _median_ms(torch, lambda: core.cuda_sum(dst.data_ptr(), n, [s.data_ptr() for s in staged],
                                                                  seg.data_ptr(), 1, [own.data_ptr()], c, st),
                                    reps=7, warmup=2)
            out.append(dict(ctas=c, n=n, ms=ms, gbps=logical / ms / 1e6, gbps_per_cta=logical / ms / 1e6 / min(c, n_sm)))
        del staged, own, dst
        torch.cuda.empty_cache()
    return out


def measure_ceiling(torch, nbytes=4 << 30):
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms, _ = _median_ms(torch, lambda: b.copy_(a), reps=10)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / ms * 1e3  # bytes/s, read + write


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tide bench layout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="llama70b,qwen3,wan22")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--sum-ctas", type=int, default=16)
    ap.add_argument("--land-ctas", type=int, default=4)
    ap.add_argument("--lanes", default="1,2,4",
                    help="copy lanes to compare (the executors' own count, TIDE_COPY_LANES, is always added)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--plot", default=None, metavar="PATH.png", help="draw a PNG (matplotlib)")
    args = ap.parse_args(argv)
    import torch
    import tide
    from tide import _core as core
    from tide import models
    if not core.cuda_available():
        print("tide bench layout: needs a CUDA GPU and a CUDA build of tide._core", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    n_sm = props.multi_processor_count
    # cudaMemcpyBatchAsync needs a real stream: run everything on one side stream.
    bench_stream = torch.cuda.Stream()
    torch.cuda.set_stream(bench_stream)
    ceiling = measure_ceiling(torch)
    sum_kernel = core.cuda_sum_kernel()  # TIDE_SUM_KERNEL (kernels.h); tide.bench.sum_sweep compares them
    result = dict(device=props.name, sms=n_sm, ceiling_gbps=ceiling / 1e9, ranks=args.ranks, groups=[], rows=[],
                  capabilities=core.cuda_capabilities(0), sum_kernel=sum_kernel)
    print(f"# {props.name}, {n_sm} SMs; device-to-device ceiling {ceiling / 1e9:.0f} GB/s (read+write); "
          f"SUM kernel variant {sum_kernel}")
    for name in args.groups.split(","):
        plan = tide.plan(models.signature(GROUPS[name], "block"), tide.Topology(1, args.ranks))
        rows, info = run_group(torch, core, name, plan, args.ranks, ceiling, n_sm, args.sum_ctas, args.land_ctas,
                              [int(x) for x in args.lanes.split(",")])
        result["rows"] += rows
        result["groups"].append(info)
    if not args.no_sweep:
        result["sum_sweep"] = sum_sweep(torch, core, args.ranks, [1, 2, 4, 6, 8, 10, 12, 14, 16, 24, 33, 48, 66, 99, 132, 264],
                                        32 << 20, 64 << 20, n_sm)
        best = max(r["gbps"] for r in result["sum_sweep"])
        sat = min(r["ctas"] for r in result["sum_sweep"] if r["gbps"] >= 0.9 * best)
        result["sum_saturation"] = dict(best_gbps=best, best_vs_ceiling=best / (ceiling / 1e9), ctas_90pct=sat)
    print(f"{'group':9} {'step':52} {'ms':>8} {'GB':>7} {'GB/s':>7} {'x floor':>7} {'kern':>4} {'cpy':>4} {'SM*ms':>7}")
    for r in result["rows"]:
        print(f"{r['group']:9} {r['step']:52} {r['ms']:8.3f} {r['bytes'] / 1e9:7.2f} {r['gbps']:7.0f} "
              f"{r['ms'] / r['floor_ms']:7.2f} {r['kernels']:4d} {r['copies']:4d} {r['sm_ms']:7.2f}")
    for info in result["groups"]:
        rs = {r["step"]: r for r in result["rows"] if r["group"] == info["group"]}
        ag_s = next(r for k, r in rs.items() if k.startswith("AG stock"))
        # The verdict uses what the executors issue: their lane count, the faster copy shape.
        ag_t = min((r for k, r in rs.items() if k.startswith("AG TIDE") and k.endswith(f", {info['exec_lanes']} lane(s)")),
                   key=lambda r: r["ms"])
        rs_s = rs["RS stock: _chunk_cat fp32 pack + packed reduce"]
        rs_t = rs["RS TIDE: staging + SUM + LAND, full grid"]
        rs_p = min((r for k, r in rs.items() if k.startswith("RS TIDE: staging in ")), key=lambda r: r["ms"])
        rs_x = rs["RS TIDE executor: staging + SUM + LAND, full grid"]
        info["rs_exec_x_floor"] = rs_x["ms"] / rs_x["floor_ms"]
        info.update(ag_bytes_ratio=ag_t["bytes"] / ag_s["bytes"], ag_time_ratio=ag_t["ms"] / ag_s["ms"],
                    ag_tide_x_floor=ag_t["ms"] / ag_t["floor_ms"], rs_bytes_ratio=rs_t["bytes"] / rs_s["bytes"],
                    rs_time_ratio=rs_t["ms"] / rs_s["ms"], rs_tide_x_floor=rs_t["ms"] / rs_t["floor_ms"],
                    rs_chunked_x_floor=rs_p["ms"] / rs_p["floor_ms"], rs_chunked_best=rs_p["step"])
        print(f"# {info['group']}: P={info['P']} NS={info['NS'] / 1e9:.2f} GB | AG TIDE/stock bytes "
              f"{info['ag_bytes_ratio']:.2f} time {info['ag_time_ratio']:.2f}, TIDE x floor {info['ag_tide_x_floor']:.2f}"
              f" | RS TIDE/stock bytes {info['rs_bytes_ratio']:.2f} time {info['rs_time_ratio']:.2f}, TIDE x floor "
              f"{info['rs_tide_x_floor']:.2f} (chunked, best {info['rs_chunked_x_floor']:.2f}: "
              f"{info['rs_chunked_best'][len('RS TIDE: '):]}; bitwise {info['rs_pieces_bitwise']}) | landing bitwise = copy-out: {info['ag_landing_bitwise']}"
              f" | RS bitwise = torch reference: {info['rs_reference_bitwise']} (executor chain, SUM "
              f"{'kernels.cu (Level-1 shape)' if info['exec_sum_level1'] else 'REDUCE'}: "
              f"{info['rs_exec_reference_bitwise']}, x floor {info['rs_exec_x_floor']:.2f}; REDUCE only: "
              f"{info['rs_reduce_reference_bitwise']})")
        for what, d in ([("one piece", info["rs_reference_diff"]), ("executor", info["rs_exec_reference_diff"]),
                         ("REDUCE only", info["rs_reduce_reference_diff"])]
                        + list(info["rs_pieces_diff"].items())):
            if d:
                print(f"#   {info['group']} {what}: {d['count']} elements differ from the reference; first {d['first']} "
                      f"(block row {d['block_row']}): want {d['want']!r}, got {d['got']!r}")
    if "sum_sweep" in result:
        print(f"{'SUM ctas':>8} {'n':>10} {'ms':>8} {'GB/s':>8} {'GB/s/CTA':>9}")
        for r in result["sum_sweep"]:
            print(f"{r['ctas']:8d} {r['n']:10d} {r['ms']:8.3f} {r['gbps']:8.0f} {r['gbps_per_cta']:9.1f}")
        sat = result["sum_saturation"]
        print(f"# SUM best {sat['best_gbps']:.0f} GB/s = {100 * sat['best_vs_ceiling']:.0f}% of the ceiling; "
              f"90% of best from {sat['ctas_90pct']} CTAs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    plot_layout(args.plot, result)
    return 0


def plot_layout(path, result) -> None:
    """Per group: ms per call of the stock layout path and TIDE's (AG: the faster TIDE variant;
    RS: staging + SUM + LAND on the training CTA budget and on a full grid)."""
    from tide.bench.common import bar_plot
    groups = {}
    for info in result["groups"]:
        rs = {r["step"]: r["ms"] for r in result["rows"] if r["group"] == info["group"]}
        groups[info["group"]] = {
            "AG stock": next(v for k, v in rs.items() if k.startswith("AG stock")),
            "AG TIDE": min(v for k, v in rs.items() if k.startswith("AG TIDE") and k.endswith(f", {info['exec_lanes']} lane(s)")),
            "RS stock": rs["RS stock: _chunk_cat fp32 pack + packed reduce"],
            "RS TIDE (training CTAs)": rs["RS TIDE: staging + SUM + LAND"],
            "RS TIDE (full grid)": rs["RS TIDE: staging + SUM + LAND, full grid"],
        }
    bar_plot(path, f"tide bench layout: {result['device']}, N = {result['ranks']} virtual ranks on one GPU "
             "(lower is better)", groups, "ms per call")


if __name__ == "__main__":
    sys.exit(main())
