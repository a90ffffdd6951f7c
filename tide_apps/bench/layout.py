"""Layout bench: FSDP2's stock layout path against the programs TIDE's executors run, on one GPU.

`tide bench layout [--groups llama70b,qwen3,wan22,llama70b_fp8,moe_shard1] [--ranks L] [--json PATH]
[--plot PATH.png]`. One GPU emulates a node of L GPUs (tide.Topology(1, L), L = --ranks, default 8):
the work of every rank of one call runs on it, stock and TIDE alike. The groups and FSDP2's stock
path for each are layout_rows.py's: the three models' blocks (bf16), llama70b_fp8 (torchao's Float8
all-gather: 1-byte items; AG rows only, its RS being the bf16 gradients') and moe_shard1 (grouped
experts sharded on dim 1, planned as rows).

  AG  stock: each rank's rank-major all-gather output (one copy of the N packed shards) and
             torch.split_with_sizes_copy into its per-parameter outputs (a Shard(k) parameter: into
             a temporary, then torch.cat on dim k), for all L ranks; the row "+ the above" adds
             FSDP2's all_gather_copy_in (the shards packed into the flat input) before it
      TIDE : one all_gather call of the 1 x L CUDA VirtualCluster: the plan's TIDE-AG programs
             (direct parameter-major landing, paper §3.1) issued by the core's GroupSession on the
             CUDA executor, under ExecutorOptions copy_lanes 1 / default / 8 x copy_2d batch / per_copy
  RS  stock: each rank's torch._chunk_cat (bf16 -> fp32 pack; a Shard(k) gradient reordered to
             dim 0 first, torch.cat of its dim-k chunks), then the packed fp32 reduce of every
             rank's chunk over the N ranks and the scale alpha, for all L ranks
      TIDE : one reduce_scatter call of the virtual cluster: the plan's TIDE-RS programs (paper
             §4.1-4.2: Level-1 staging copies, SUM, stale-block ZERO, the spare copy, LAND; the rows
             keep the name "staging + SUM + LAND"), with the plan's solver budgets (§6.3), with a full
             grid (sum_ctas / land_ctas = SMs x resident CTAs of the kernel the ops run), and at the
             full grid under ExecutorOptions(cta_split='ranges') and (full_grid='wave')
  SUM sweep (first group): rank 0's SUM op(s) on the run table the CUDA executor builds
             (tide._core.testing.run_table, packed by the core), launched as the executors launch
             them (ReduceOp below), at several CTA budgets
Columns: ms is the median device time of one call. The host enqueues each call while a spin
kernel holds torch's stream, so CUDA events there bracket only the GPU work (for TIDE the host
enqueue, JSON enqueue_ms, is left out as the stock rows' events leave out torch's launches).
GB: HBM bytes read + written. Stock: those of the torch ops. TIDE: those of every rank's program,
read off the core's listings: each COPY / PUT descriptor (ProgramSet.describe, width x height) and
each SUM / LAND run table (each present term read, the fp32 destination written); ZERO ops carry
no size there and are not counted, so their time shows as time above the floor. x floor: ms over
the time those bytes take at the measured device-to-device ceiling (a 4 GiB copy). kern / cpy /
SM*ms: with --profile, the torch profiler's kernels, copies and SM-milliseconds of one call (SMs
of a kernel: min(CTAs, SMs)); the RS rows' time by kernel is printed under the table ("parts":
summed durations, overlapping streams add up). Off by default: once the profiler has run, CUPTI
stays attached to the process and every later TIDE call (hundreds of kernels and stream memory
operations across 2 L streams) runs slower (BENCHMARKS.md, the profiler's cost: the 70B RS call
11.8 ms without, 14.4 ms after a profile pass); the stock rows' few large kernels do not notice.
Checks: every AG variant's landing, on every rank, equals the stock copy-out bit for bit (as the
unsharded parameters' bytes: a Shard(k) parameter's rows back to back). Every RS
variant's outputs, on every rank, equal the CPU VirtualCluster's bit for bit (--cpu-check auto runs
it where its L arenas fit in half the host's free memory; elsewhere the reference is the stock
output, which is exact: integer-valued bf16 gradients and alpha = 1/L, L a power of two, give the
same bits in every association), and so do the stock outputs where the CPU cluster ran.
On one GPU every copy is a same-device copy between ranks that share the device: the executors run
those on TIDE's copy kernel (ExecutorOptions copies_on auto, exec/cuda/runtime.h [Note: copies on
SMs]); between GPUs the same descriptors run on copy engines. Peers' buffers live on the same GPU,
so "peer" reads are local. The GPU runner runs this bench with CUDA_DEVICE_MAX_CONNECTIONS unset
(the driver's default, 8, what a training process gets): the header names the value in force.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

# The groups (layout_rows.py): GROUPS, the plain ones (bench name -> built-in model, tide/models.py);
# NAMES, every group --groups takes (llama70b_fp8, moe_shard1 too). The RS references live there too.
from tide_apps.bench.layout_rows import (GROUPS, NAMES, _np_grads, _plan_layout, bit_diff,  # noqa: E402,F401
                                         cpu_reference, rs_diff)

AG_STOCK = "AG stock: rank-major + split_with_sizes_copy"   # the collective + copy-out (+ cat on dim k)
AG_STOCK_FULL = "AG stock: all_gather_copy_in + the above"   # FSDP2's whole layout path
RS_STOCK = "RS stock: _chunk_cat fp32 pack + packed reduce"
RS_TIDE = "RS TIDE: staging + SUM + LAND"          # the reduce_scatter call, solver budgets
RS_FULL = RS_TIDE + ", full grid"
_OP = re.compile(r"(\d+) (\w+) ")                                        # describe(): "<i> KIND ..."
_DESC = re.compile(r"\{\w+@\d+\+\d+ -> \w+@\d+\+\d+ (\d+)x(\d+)\}")      # a copy: width x height


def _layout(plan):
    """The plan's per-parameter layout (paper §2.1) as lists: D, K, R, e_p = R_p*K_p, o = o32_p."""
    ps = plan.layout.params
    return SimpleNamespace(D=[p.D for p in ps], K=[p.K for p in ps], R=[p.R for p in ps],
                           e=[p.e for p in ps], o=[p.o32 for p in ps], E=plan.layout.E)


# ---- timing and profiles -----------------------------------------------------------------------
def _median_ms(torch, fn, reps=10, warmup=3):
    from tide_apps.bench.common import time_cuda
    times = time_cuda(torch, fn, reps, warmup)
    return statistics.median(times), (min(times), max(times))


def _call_ms(torch, enqueue, finish=None, reps=10, warmup=3):
    """(median ms, (min, max), median host enqueue ms) of one call's GPU work: enqueue() issues it
    on torch's current stream (a virtual-cluster call: its streams wait for that stream's prior
    work and it waits for them, tide/cluster_cuda.py [Note: stream handoff]); finish() waits for
    the host side. A spin kernel ahead of the first event outlasts the enqueue."""
    enq = []
    for _ in range(warmup):
        t = time.perf_counter()
        enqueue()
        enq.append((time.perf_counter() - t) * 1e3)
        if finish:
            finish()
    torch.cuda.synchronize()
    spin = int(2e6 * (1.0 + 3 * max(enq or [0.0])))  # cycles (~2 GHz)
    sleep = getattr(torch.cuda, "_sleep", None)
    times, enq = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep:
            sleep(spin)
        a.record()
        t = time.perf_counter()
        enqueue()
        enq.append((time.perf_counter() - t) * 1e3)
        b.record()
        b.synchronize()
        if finish:
            finish()
        times.append(a.elapsed_time(b))
    return statistics.median(times), (min(times), max(times)), statistics.median(enq)


def _kernel_name(name):
    """A kernel's profiler name without namespaces and arguments: sum_kernel<7>, reduce_kernel<8,1>
    (template arguments as the compiler printed their values)."""
    m = re.search(r"(\w+)<([^<>]*)>\s*\(", name)
    if m:
        args = [re.sub(r".*\)", "", a).strip() for a in m.group(2).split(",")]
        return m.group(1) + "<" + ",".join(args) + ">"
    m = re.search(r"(\w+)\s*\(", name)
    return m.group(1) if m else name[:40]


def trace_events(torch, fn, gate_ms=None):
    """The chrome-trace events of one profiled call of fn (after one unprofiled call). gate_ms: the
    call's host time; a spin kernel of about three times it is issued first, as _call_ms does, so
    the GPU sees the whole call at once (its events are named spin/sleep)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None) if gate_ms is not None else None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if sleep:
            sleep(int(2e6 * (1.0 + 3 * gate_ms)))
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    return trace.get("traceEvents", [])


def _profile_parts(torch, fn, n_sm):
    """Kernel count, copy count and SM*ms of one call of fn (SMs of a kernel = min(CTAs, SMs)), and
    its GPU time by kernel: {name: dict(count, ms, sm_ms)}, copies as 'memcpy' (summed durations)."""
    events = trace_events(torch, fn)
    kernels = copies = 0
    sm_ms = 0.0
    parts = {}
    for ev in events:
        cat, ms = ev.get("cat", ""), ev.get("dur", 0) / 1e3
        if cat == "kernel":
            kernels += 1
            g = ev.get("args", {}).get("grid", [1, 1, 1])
            sm = min(g[0] * g[1] * g[2], n_sm) * ms
            sm_ms += sm
            p = parts.setdefault(_kernel_name(ev.get("name", "?")), dict(count=0, ms=0.0, sm_ms=0.0))
        elif cat == "gpu_memcpy":
            copies += 1
            sm = 0.0
            p = parts.setdefault("memcpy", dict(count=0, ms=0.0, sm_ms=0.0))
        else:
            continue
        p["count"] += 1
        p["ms"] += ms
        p["sm_ms"] += sm
    return kernels, copies, sm_ms, parts


def _profile(torch, fn, n_sm):
    """Kernel count, copy count and SM*ms of one call (SMs of a kernel = min(CTAs, SMs))."""
    return _profile_parts(torch, fn, n_sm)[:3]


def measure_ceiling(torch, nbytes=4 << 30):
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms, _ = _median_ms(torch, lambda: b.copy_(a), reps=10)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / ms * 1e3  # bytes/s, read + write


# --profile: the layout rows' profiler pass (module docstring: it slows every later TIDE call).
PROFILE_ROWS = False


def _measure(torch, fn_enqueue, finish, profile_fn, nbytes, ceiling, n_sm, reps):
    ms, spread, enq = _call_ms(torch, fn_enqueue, finish, reps)
    k, c, smms, parts = _profile_parts(torch, profile_fn, n_sm) if PROFILE_ROWS else (0, 0, 0.0, {})
    return dict(ms=ms, spread=spread, enqueue_ms=enq, bytes=nbytes, gbps=nbytes / ms / 1e6,
                floor_ms=nbytes / ceiling * 1e3, kernels=k, copies=c, sm_ms=smms, parts=parts)


def _release(torch):
    gc.collect()  # a VirtualCluster and its backend refer to each other: its arenas go here
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---- the programs' own tables ---------------------------------------------------------------------
def table_bytes(table):
    """HBM bytes of one SUM / LAND run table (testing.run_table's tuple): every present term's
    elements read at its item size, the fp32 destination written."""
    n, _, fp32, runs = table[:4]
    read = sum(ln * sum(4 if fp32 >> t & 1 else 2 for t, s in enumerate(slots) if s >= 0)
               for _, ln, slots, _ in runs)
    return read + 4 * n


def program_bytes(core, ps, world):
    """HBM bytes (read + write) of the data ops of every rank's program in `ps`: each COPY / PUT
    descriptor of describe() (width x height, read and written; a CAST reads fp32 and writes half
    of it) and each SUM / LAND run table. ZERO ops are listed without a size: not counted."""
    total = 0
    for r in range(world):
        for line in ps.describe(r):
            m = _OP.match(line)
            kind = m.group(2) if m else ""
            if kind in ("COPY", "PUT"):
                total += sum(2 * int(w) * int(h) for w, h in _DESC.findall(line))
            elif kind == "CAST":
                total += sum(3 * int(w) * int(h) // 2 for w, h in _DESC.findall(line))
            elif kind in ("SUM", "LAND"):
                total += table_bytes(core.testing.run_table(ps, r, int(m.group(1))))
    return total


def reduce_ops(core, ps, rank):
    """Rank `rank`'s SUM and LAND ops in program order: dict(op, kind, table), the table being the
    run table the CUDA executor builds for the op (tide._core.testing.run_table)."""
    out = []
    for line in ps.describe(rank):
        m = _OP.match(line)
        if m and m.group(2) in ("SUM", "LAND"):
            out.append(dict(op=int(m.group(1)), kind=m.group(2),
                            table=core.testing.run_table(ps, rank, int(m.group(1)))))
    return out


def kernel_of(op, reduce=False):
    """(kernel, n_staged) for resident_ctas_per_sm of what an op runs on the CUDA executors
    (exec/cuda/issue.h [Note: Level-1 SUM on kernels.cu's SUM]): kernels.cu's SUM when the core reports
    the Level-1 shape (unless `reduce`), else REDUCE with its bf16 or fp32 terms."""
    _, n_terms, fp32, _, _, level1, _, _ = op["table"]
    if level1 is not None and not reduce:
        return "sum", len(level1)
    return ("reduce_fp32" if fp32 == (1 << n_terms) - 1 else "reduce"), n_terms


def full_grid(core, ops, kind, n_sm, reduce=False):
    """A full-grid budget for the `kind` ops (kernels.h [Note: full grid]): SMs x the most CTAs of
    their kernels resident on one SM."""
    return n_sm * max([1] + [core.cuda.resident_ctas_per_sm(*kernel_of(o, reduce)) for o in ops if o["kind"] == kind])


def slot_sources(core, table, op=-1):
    """{slot: (source, item size, first byte, end byte)} of a run table: what each slot stands for
    (the core's answer, testing.run_table's slots: ('grad', param) a gradient of the rank,
    ('out',) its output, ('arena', rank) a rank's arena) and the bytes the op reads there."""
    _, _, fp32, runs, _, _, _, slot_of = table
    src = {}
    for _, ln, slots, offs in runs:
        for t, (slot, off) in enumerate(zip(slots, offs)):
            if slot < 0:
                continue
            isz = 4 if fp32 >> t & 1 else 2
            w, i, lo, hi = src.get(slot, (slot_of[slot], isz, off, off))
            if i != isz:
                raise RuntimeError(f"op {op}: slot {slot} is read as {i}- and {isz}-byte items")
            src[slot] = (w, isz, min(lo, off), max(hi, off + ln * isz))
    return src


class ReduceOp:
    """One SUM / LAND op of a program, launched as the CUDA executors launch it (executor.cc
    issue()): kernels.cu's SUM for an op the core reports in the Level-1 shape, else REDUCE on the
    op's run table; launch(reduce=True) runs REDUCE on the same table either way. The run table
    and the Level-1 operands are the core's (testing.run_table; cuda.reduce_runs and
    cuda.sum_segments pack them). This class only binds buffers to the table's slots, as issue()
    does with a call's buffers: each slot's source (a gradient of the rank, its output, or a
    rank's arena) is the core's slot map (testing.run_table); a gradient slot takes `grads[index]` when given,
    every other slot a fresh device buffer spanning the bytes the op reads there (small random
    integers), placed so every operand keeps its offset modulo 4 KiB. Host tables stay untouched."""

    def __init__(self, torch, core, op, alpha=1.0, grads=None):
        self.core, self.kind, self.op = core, op["kind"], op["op"]
        n, n_terms, fp32, runs, _, level1, _, _ = op["table"]
        self.n, self.n_terms, self.fp32, self.level1 = n, n_terms, fp32, level1
        self.alpha = alpha if self.kind == "LAND" else 1.0
        self.bytes = table_bytes(op["table"])
        src = slot_sources(core, op["table"], self.op)
        self.keep, bases = [], {}
        for slot, (where, isz, lo, hi) in src.items():
            if where[0] == "grad" and grads is not None:
                g = grads[where[1]]
                if hi > g.numel() * g.element_size():
                    raise RuntimeError(f"op {self.op}: reads {hi} bytes of gradient {where[1]}")
                bases[slot] = g.data_ptr()
                continue
            lo0 = lo // 4096 * 4096
            buf = torch.empty(-(-(hi - lo0) // 16) * 16, dtype=torch.uint8, device="cuda")
            buf.view(torch.bfloat16 if isz == 2 else torch.float32).random_(-4, 5)
            self.keep.append(buf)
            bases[slot] = buf.data_ptr() - lo0
        self.bases = [bases.get(s, 0) for s in range(max(bases, default=0) + 1)]
        self.dst = torch.empty(n, dtype=torch.float32, device="cuda")
        self.runs = core.cuda.reduce_runs([(d0, ln, [(s, o) if s >= 0 else None for s, o in zip(slots, offs)])
                                           for d0, ln, slots, offs in runs])
        if level1 is not None:
            self.staged = [self.bases[s] + o for s, o in level1]
            self.segs = core.cuda.sum_segments(op["table"][6])  # the executor's own segment table
            self.grad_bases = self.bases[:256]

    def runs_on(self, reduce=False):
        return "kernels.cu SUM" if self.level1 is not None and not reduce else "REDUCE"

    def launch(self, ctas, stream, options=None, reduce=False):
        c = self.core.cuda
        if self.level1 is not None and not reduce:
            c.sum(self.dst.data_ptr(), self.n, self.staged, self.segs.ptr, self.segs.count, self.grad_bases,
                  ctas, stream, options)
        else:
            c.reduce(self.dst.data_ptr(), self.n, self.runs.ptr, self.runs.count, self.n_terms, self.fp32,
                     self.kind == "LAND", False, self.alpha, self.bases, ctas, stream, options)


def level1_matches_reduce(torch, ops, ctas, stream):
    """Every Level-1 SUM gives REDUCE's bits on the same table (the same association)."""
    for o in ops:
        if o.level1 is None:
            continue
        o.launch(ctas, stream, reduce=True)
        want = o.dst.clone()
        o.dst.fill_(float("nan"))
        o.launch(ctas, stream)
        torch.cuda.synchronize()
        if not torch.equal(want.view(torch.int32), o.dst.view(torch.int32)):
            return False
    return True


# ---- AG -----------------------------------------------------------------------------------------
def run_ag(torch, tide, core, grp, plan, L, ceiling, n_sm, lanes, copy_2d, reps):
    """The AG rows of group `grp` (layout_rows.Group): FSDP2's stock path (layout_rows.StockAllGather)
    and the TIDE all_gather call per variant; every rank's landing, as the unsharded parameters'
    bytes, equals the stock copy-out's bit for bit."""
    from tide_apps.bench import layout_rows as lr
    shards = lr.make_shards(torch, grp, L, "cuda")
    st = lr.StockAllGather(torch, grp, shards, L)
    b = st.bytes

    def stock():
        st.collective()
        st.copy_out()
    rows = [dict(step=AG_STOCK, **_measure(torch, stock, None, stock, b["collective"] + b["copy_out"],
                                           ceiling, n_sm, reps)),
            dict(step=AG_STOCK_FULL, **_measure(torch, st, None, st, sum(b.values()), ceiling, n_sm, reps))]
    st()
    ref = [t.clone() for t in st.unsharded(0)]  # every rank's unsharded parameters are the same
    del st
    _release(torch)
    ok, nbytes = True, None
    inputs = [lr.item_shards(grp, L, shards[r]) for r in range(L)]
    for c2 in copy_2d:
        for ln in lanes:
            opts = tide.ExecutorOptions(copy_lanes=ln, copy_2d=c2)
            vc = tide.VirtualCluster(tide.Topology(1, L), backend="cuda", check=False, options=opts)
            full, go, landing = vc.all_gather_runner(plan, inputs)
            same = all(torch.equal(x, y) for r in range(L)
                       for x, y in zip(lr.unsharded_from_items(torch, grp, L, full[r]), ref))
            ok = ok and same
            if nbytes is None:  # the call's own programs
                nbytes = program_bytes(core, vc.session(plan, "all_gather", ring_slot=0, resident=True, multicast=False,
                                                        expert_lane=False)[0].programs("all_gather", 1), L)
            del full, landing
            rows.append(dict(step=f"AG TIDE: all_gather call, copy_2d {c2}, {ln} lane(s)", landing_bitwise=same,
                             **_measure(torch, go.enqueue, go.synchronize, go, nbytes, ceiling, n_sm, reps)))
            del vc, go  # every reference to the cluster: its arenas go before the next one's
            _release(torch)
    del shards, inputs, ref
    _release(torch)
    return rows, dict(ag_landing_bitwise=ok, ag_tide_bytes=nbytes, ag_stock_bytes=b)


# ---- RS -----------------------------------------------------------------------------------------
def run_rs(torch, tide, core, grp, plan, L, ceiling, n_sm, reps, cpu_check, sweep):
    from tide_apps.bench import layout_rows as lr
    lay = _layout(plan)
    Es = sum(lay.e)  # stock: _chunk_cat's packing, parameter after parameter (a Shard(k) one's rows)
    alpha = 1.0 / L
    ns = L * 2 * Es
    # Integer-valued gradients: every fp32 sum of L of them, times 1/L, is exact in any order.
    whole = lr.make_grads(torch, grp, L, "cuda")  # the unsharded gradients
    grads = [lr.item_grads(grp, L, whole[u]) for u in range(L)]  # TIDE reads them in place
    # FSDP2's Shard(k) reorder (foreach_reduce) into buffers of its own; dim-0 gradients as they are.
    dims = [d for _, _, d in grp.params]
    inputs = [[torch.empty(lr.reordered_shape(x.shape, d, L), dtype=x.dtype, device=x.device) if d else x
               for x, d in zip(whole[u], dims)] for u in range(L)]
    rows = []
    packed = torch.empty(L, L, Es, dtype=torch.float32, device="cuda")
    out = torch.empty(L, Es, dtype=torch.float32, device="cuda")

    def reorder():
        for u in range(L):
            for x, y, d in zip(whole[u], inputs[u], dims):
                if d:
                    torch.cat(torch.chunk(x, L, dim=d), dim=0, out=y)

    def pack():
        for u in range(L):
            torch._chunk_cat(inputs[u], dim=0, num_chunks=L, out=packed[u])

    def reduce():
        torch.sum(packed, dim=0, out=out)
        out.mul_(alpha)

    def stock():
        reorder()
        pack()
        reduce()
    steps = [("RS stock: _chunk_cat bf16 -> fp32 pack", pack, 3 * L * ns),
             ("RS stock: packed fp32 reduce of the chunk + alpha", reduce, 2 * L * ns + 6 * ns),
             (RS_STOCK, stock, 5 * L * ns + 6 * ns + lr.stock_rs_reorder_bytes(grp, L))]
    if grp.shard_dims:
        steps.insert(0, ("RS stock: Shard(k) reorder, torch.cat of dim-k chunks", reorder,
                         lr.stock_rs_reorder_bytes(grp, L)))
    for label, fn, nbytes in steps:
        rows.append(dict(step=label, **_measure(torch, fn, None, fn, nbytes, ceiling, n_sm, reps)))
    stock()
    stock_out = [_plan_layout(torch, lay, out[r]) for r in range(L)]
    del packed, out, inputs
    _release(torch)
    ref, ref_name = cpu_reference(torch, tide, plan, L, grads, alpha, cpu_check)
    stock_ok = None
    if ref is None:
        ref, exact = stock_out, L & (L - 1) == 0
        ref_name = "stock outputs (exact)" if exact else "stock outputs (not exact: L is not a power of two)"
        cpu_note = ref_name
    else:
        stock_ok = rs_diff(torch, lay, ref, stock_out) is None
        cpu_note = "ran"
    del stock_out
    # Variants after the first run on a full grid: SMs x resident CTAs of the kernels that rank 0's
    # SUM / LAND ops run, read off the run tables of the call's own programs (the first session's).
    variants = [(RS_TIDE, {}, False), (RS_FULL, {}, True), (RS_FULL + ", CTA ranges", dict(cta_split="ranges"), True),
                (RS_FULL + ", one wave", dict(full_grid="wave"), True)]
    ok, first_diff, budgets, ps = True, None, {}, None
    sum_full = land_full = nbytes = ops = None
    for label, opts, full in variants:
        vc = tide.VirtualCluster(tide.Topology(1, L), backend="cuda", check=False,
                                 options=tide.ExecutorOptions(**opts), sum_ctas=sum_full if full else None,
                                 land_ctas=land_full if full else None)
        outs, go = vc.reduce_scatter_runner(plan, grads, scale=alpha)
        s, ex = vc.session(plan, "reduce_scatter")
        if ps is None:
            ps = s.programs("reduce_scatter", 1, alpha, False)
            ops = reduce_ops(core, ps, 0)
            sum_full, land_full = full_grid(core, ops, "SUM", n_sm), full_grid(core, ops, "LAND", n_sm)
            nbytes = program_bytes(core, ps, L)
        budgets[label] = (s.sum_ctas, s.land_ctas)
        row = dict(step=label, sum_ctas=s.sum_ctas, land_ctas=s.land_ctas,
                   **_measure(torch, go.enqueue, ex.synchronize, go, nbytes, ceiling, n_sm, reps))
        d = rs_diff(torch, lay, ref, outs)
        row["reference_bitwise"] = d is None
        ok = ok and d is None
        first_diff = first_diff or (d and dict(step=label, **d))
        rows.append(row)
        del vc, go, outs, s, ex
        _release(torch)
    info = dict(rs_reference_bitwise=ok, rs_reference=ref_name, rs_reference_diff=first_diff,
                rs_cpu_check=cpu_note, rs_stock_bitwise=stock_ok, rs_tide_bytes=nbytes,
                sum_ctas_solver=budgets[RS_TIDE][0], land_ctas_solver=budgets[RS_TIDE][1],
                sum_full_ctas=sum_full, land_full_ctas=land_full)
    del ref
    if sweep:
        info["sum_sweep"] = sum_ctas_sweep(torch, core, ops, grads[0], sweep, n_sm)
    del grads, whole
    _release(torch)
    return rows, info


def sum_ctas_sweep(torch, core, ops, grads0, ctas_list, n_sm):
    """Rank 0's SUM op(s) at each CTA budget: ms, logical GB/s (the run tables' bytes), GB/s per CTA."""
    st = torch.cuda.current_stream().cuda_stream
    sums = [ReduceOp(torch, core, o, grads=grads0) for o in ops if o["kind"] == "SUM"]
    nbytes = sum(o.bytes for o in sums)
    full = full_grid(core, ops, "SUM", n_sm)
    out = dict(runs_on=sorted({o.runs_on() for o in sums}), bytes=nbytes,
               level1_matches_reduce=level1_matches_reduce(torch, sums, full, st), rows=[])
    for c in sorted(set(ctas_list) | {full}):
        ms, _ = _median_ms(torch, lambda c=c: [o.launch(c, st) for o in sums], reps=7, warmup=2)
        out["rows"].append(dict(ctas=c, split=core.cuda.split_for(c), full_grid=c == full, ms=ms,
                                gbps=nbytes / ms / 1e6, gbps_per_cta=nbytes / ms / 1e6 / min(c, n_sm)))
    del sums
    return out


# ---- the bench ----------------------------------------------------------------------------------
def _ints(text, what, lo=1, hi=1 << 20):
    try:
        v = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"tide bench layout: {what}: expected integers, got {text!r}") from None
    if not v or any(not lo <= x <= hi for x in v):
        raise SystemExit(f"tide bench layout: {what}: expected values in [{lo}, {hi}], got {text!r}")
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tide bench layout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="llama70b,qwen3,wan22", help=f"of {', '.join(NAMES)}")
    ap.add_argument("--ranks", type=int, default=8, help="L: virtual ranks of the one node (default 8)")
    ap.add_argument("--lanes", default="1,8", help="AG copy_lanes variants (ExecutorOptions' default is always added)")
    ap.add_argument("--copy-2d", default="batch,per_copy", help="AG copy_2d variants")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per row")
    ap.add_argument("--cpu-check", choices=("auto", "on", "off"), default="auto",
                    help="RS reference: the CPU VirtualCluster (auto: where its arenas fit in half the free "
                         "host memory)")
    ap.add_argument("--sweep-ctas", default="1,2,4,8,16,32,66,132,264", help="SUM sweep budgets (first group)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="profile every row (kern / cpy / SM*ms, parts); slows the TIDE rows after the first profile")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--plot", default=None, metavar="PATH.png", help="draw a PNG (matplotlib)")
    args = ap.parse_args(argv)
    global PROFILE_ROWS
    PROFILE_ROWS = args.profile
    groups = [g for g in args.groups.split(",") if g]
    if not groups or any(g not in NAMES for g in groups):
        ap.error(f"--groups: expected names of {', '.join(NAMES)}, got {args.groups!r}")
    if args.ranks < 2 or args.reps < 1:
        ap.error("--ranks must be >= 2 and --reps >= 1")
    copy_2d = [c for c in args.copy_2d.split(",") if c]
    if not copy_2d or any(c not in ("batch", "per_copy") for c in copy_2d):
        ap.error(f"--copy-2d: expected batch and/or per_copy, got {args.copy_2d!r}")
    import torch

    import tide
    from tide import _core as core
    from tide_apps.bench import layout_rows
    from tide_apps.bench.common import progress, write_json
    default_lanes = tide.ExecutorOptions().copy_lanes
    lanes = sorted(set(_ints(args.lanes, "--lanes", 1, 8)) | {default_lanes})
    sweep = [] if args.no_sweep else _ints(args.sweep_ctas, "--sweep-ctas", 1, 65536)
    if not core.cuda.available():
        print("tide bench layout: needs a CUDA GPU and a CUDA build of tide._core", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    n_sm = props.multi_processor_count
    # cudaMemcpyBatchAsync needs a real stream: run everything on one side stream.
    torch.cuda.set_stream(torch.cuda.Stream())
    ceiling = measure_ceiling(torch)
    effective = tide.ExecutorOptions().effective()
    # The L ranks' 2 L streams share the GPU's hardware queues: how many there are changes how
    # their WAITs are serviced (BENCHMARKS.md, the hardware queues), so the header names it.
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (the driver's default, 8)")
    result = dict(device=props.name, sms=n_sm, ceiling_gbps=ceiling / 1e9, ranks=args.ranks, groups=[], rows=[],
                  capabilities=core.cuda.capabilities(0), executor_options=effective,
                  cuda_device_max_connections=connections, profiled=args.profile)
    print(f"# {props.name}, {n_sm} SMs; device-to-device ceiling {ceiling / 1e9:.0f} GB/s (read+write); "
          f"L = {args.ranks} virtual ranks on one GPU; CUDA_DEVICE_MAX_CONNECTIONS {connections}; "
          f"executor options {effective}; profiler {'on (later TIDE rows run slower)' if args.profile else 'off'}")
    if os.environ.get("TIDE_EXEC_OPTIONS"):
        print(f"# TIDE_EXEC_OPTIONS={os.environ['TIDE_EXEC_OPTIONS']} overrides every variant's options")
    swept = False
    for name in groups:
        grp = layout_rows.group(name)
        plan = tide.plan(group_signature(grp, args.ranks), tide.Topology(1, args.ranks))
        progress(f"layout {name}: AG, {len(lanes) * len(copy_2d)} TIDE variants")
        ag_rows, ag_info = run_ag(torch, tide, core, grp, plan, args.ranks, ceiling, n_sm, lanes, copy_2d, args.reps)
        rs_rows, rs_info = [], {}
        if grp.rs:
            progress(f"layout {name}: RS")
            rs_rows, rs_info = run_rs(torch, tide, core, grp, plan, args.ranks, ceiling, n_sm, args.reps,
                                      args.cpu_check, [] if swept else sweep)
            swept = True
        E, S = plan.layout.E, plan.layout.S
        info = dict(group=name, note=grp.note, item=grp.item, P=plan.layout.P, params=len(grp.params), E=E, S=S,
                    NS=args.ranks * S, exec_lanes=default_lanes, rs=grp.rs, **ag_info, **rs_info)
        if grp.item != "bfloat16":  # the same weights in bf16: the plan's AG bytes beside these
            bf16 = tide.plan(group_signature(grp, args.ranks, "bfloat16"), tide.Topology(1, args.ranks))
            info["ag_bytes_vs_bf16"] = ag_info["ag_tide_bytes"] / program_bytes(core, core.build_ag_programs(bf16),
                                                                                args.ranks)
        if "sum_sweep" in info:
            result["sum_sweep"] = dict(group=name, **info.pop("sum_sweep"))
        for r in ag_rows + rs_rows:
            result["rows"].append(dict(group=name, **r))
        _verdict(info, {r["step"]: r for r in ag_rows + rs_rows})
        result["groups"].append(info)
    if "sum_sweep" in result:
        sw = result["sum_sweep"]
        best = max(r["gbps"] for r in sw["rows"])
        sw["saturation"] = dict(best_gbps=best, best_vs_ceiling=best / (ceiling / 1e9),
                                ctas_90pct=min(r["ctas"] for r in sw["rows"] if r["gbps"] >= 0.9 * best))
    _print(result)
    write_json(args.json, result)
    plot_layout(args.plot, result)
    bad = [i["group"] for i in result["groups"] if not _group_ok(i)]
    return 1 if bad else 0


def group_signature(grp, L, item=None):
    """The signature the bench plans for a group: a plain group's is tide.models' (the paper's
    block, as before), the others' layout_rows.signature (Shard(k) as rows, 1-byte items);
    `item` overrides the AG item dtype (the fp8 group's bf16 twin)."""
    from dataclasses import replace

    from tide import models
    from tide_apps.bench import layout_rows
    if grp.name in GROUPS and item is None:
        return models.signature(GROUPS[grp.name], "block")
    return layout_rows.signature(grp if item is None else replace(grp, item=item), L)


def _group_ok(i):
    return i["ag_landing_bitwise"] and (not i["rs"] or (i["rs_reference_bitwise"] and i["rs_stock_bitwise"] is not False))


def _verdict(info, rs):
    """Per group: TIDE / stock bytes and time (AG: the executors' default lanes, the faster copy_2d;
    RS: the full grid, and the solver's budgets)."""
    ag_s, ag_f = rs[AG_STOCK], rs[AG_STOCK_FULL]
    ag_t = min((r for k, r in rs.items() if k.startswith("AG TIDE") and k.endswith(f", {info['exec_lanes']} lane(s)")),
               key=lambda r: r["ms"])
    info.update(ag_bytes_ratio=ag_t["bytes"] / ag_s["bytes"], ag_time_ratio=ag_t["ms"] / ag_s["ms"],
                ag_full_bytes_ratio=ag_t["bytes"] / ag_f["bytes"], ag_full_time_ratio=ag_t["ms"] / ag_f["ms"],
                ag_tide_x_floor=ag_t["ms"] / ag_t["floor_ms"], ag_tide_best=ag_t["step"])
    if not info["rs"]:
        return
    rs_s, rs_t, rs_b = rs[RS_STOCK], rs[RS_FULL], rs[RS_TIDE]
    info.update(rs_bytes_ratio=rs_t["bytes"] / rs_s["bytes"], rs_time_ratio=rs_t["ms"] / rs_s["ms"],
                rs_tide_x_floor=rs_t["ms"] / rs_t["floor_ms"], rs_solver_time_ratio=rs_b["ms"] / rs_s["ms"],
                rs_solver_x_floor=rs_b["ms"] / rs_b["floor_ms"])


def _parts_line(parts, ms):
    top = sorted(parts.items(), key=lambda kv: -kv[1]["ms"])[:5]
    return ", ".join(f"{k} {v['count']}x {v['ms']:.2f} ms" for k, v in top) + f" (call {ms:.2f} ms)"


def _print(result):
    print(f"{'group':12} {'step':58} {'ms':>8} {'GB':>7} {'GB/s':>7} {'x floor':>7} {'kern':>4} {'cpy':>4} {'SM*ms':>7}")
    for r in result["rows"]:
        print(f"{r['group']:12} {r['step']:58} {r['ms']:8.3f} {r['bytes'] / 1e9:7.2f} {r['gbps']:7.0f} "
              f"{r['ms'] / r['floor_ms']:7.2f} {r['kernels']:4d} {r['copies']:4d} {r['sm_ms']:7.2f}")
    for r in result["rows"]:
        if r["step"] in (RS_TIDE, RS_FULL) and r["parts"]:
            budget = f"SUM {r['sum_ctas']} / LAND {r['land_ctas']} CTAs"
            print(f"#   parts {r['group']} {r['step'][len('RS TIDE: '):]} ({budget}): "
                  f"{_parts_line(r['parts'], r['ms'])}")
    if "sum_sweep" in result:
        sw = result["sum_sweep"]
        print(f"{'SUM ctas':>8} {'split':>6} {'ms':>8} {'GB/s':>8} {'GB/s/CTA':>9}")
        for r in sw["rows"]:
            print(f"{r['ctas']:8d} {r['split']:>6} {r['ms']:8.3f} {r['gbps']:8.0f} {r['gbps_per_cta']:9.1f}"
                  + ("  full grid" if r["full_grid"] else ""))
        sat = sw["saturation"]
        print(f"# SUM sweep ({sw['group']}, rank 0's SUM on {'/'.join(sw['runs_on'])}, {sw['bytes'] / 1e9:.2f} GB; "
              f"same bits as REDUCE: {sw['level1_matches_reduce']}): best {sat['best_gbps']:.0f} GB/s = "
              f"{100 * sat['best_vs_ceiling']:.0f}% of the ceiling; 90% of best from {sat['ctas_90pct']} CTAs")
    for i in result["groups"]:
        print(_group_line(i))
    ok = all(_group_ok(i) for i in result["groups"])
    rs_groups = [i for i in result["groups"] if i["rs"]]
    print("# layout: TIDE/stock time AG " + "/".join(f"{i['ag_time_ratio']:.2f}" for i in result["groups"])
          + f" ({', '.join(i['group'] for i in result['groups'])}), with copy-in "
          + "/".join(f"{i['ag_full_time_ratio']:.2f}" for i in result["groups"])
          + ", RS full grid " + "/".join(f"{i['rs_time_ratio']:.2f}" for i in rs_groups)
          + f" ({', '.join(i['group'] for i in rs_groups)}); bitwise checks {'ok' if ok else 'FAILED'}")


def _group_line(i):
    """One group's verdict: TIDE / stock ratios (bytes, time), x floor, the bitwise checks."""
    line = (f"# {i['group']}: P={i['P']} NS={i['NS'] / 1e9:.2f} GB | AG TIDE/stock bytes {i['ag_bytes_ratio']:.2f} "
            f"time {i['ag_time_ratio']:.2f} ({i['ag_tide_best'][len('AG TIDE: all_gather call, '):]}), with copy-in "
            f"bytes {i['ag_full_bytes_ratio']:.2f} time {i['ag_full_time_ratio']:.2f}, x floor {i['ag_tide_x_floor']:.2f}")
    if "ag_bytes_vs_bf16" in i:
        line += f" | {i['item']} items: AG bytes {i['ag_bytes_vs_bf16']:.2f} x the bf16 group's"
    line += f" | landing bitwise = copy-out: {i['ag_landing_bitwise']}"
    if not i["rs"]:
        return line + " | RS: the bf16 gradients' (not this group's rows)"
    d = i["rs_reference_diff"]
    return (line + f" | RS TIDE/stock bytes {i['rs_bytes_ratio']:.2f} time {i['rs_time_ratio']:.2f} "
            f"full grid ({i['sum_full_ctas']} / {i['land_full_ctas']} CTAs), x floor {i['rs_tide_x_floor']:.2f}; "
            f"solver budgets ({i['sum_ctas_solver']} / {i['land_ctas_solver']}) {i['rs_solver_time_ratio']:.2f} | "
            f"RS bitwise = {i['rs_reference']}: {i['rs_reference_bitwise']}"
            + ("" if i["rs_stock_bitwise"] is None else f" (stock too: {i['rs_stock_bitwise']})")
            + ("" if not d else f"; first difference {d['step']}: rank {d['rank']}, {d['count']} elements, "
               f"element {d['first']}: want {d['want']!r}, got {d['got']!r}"))


def plot_layout(path, result) -> None:
    """Per group: ms per call of the stock layout path and TIDE's (AG: the faster copy_2d at the
    executors' default lanes; RS: the reduce_scatter call on the solver's budgets and on a full grid)."""
    from tide_apps.bench.common import bar_plot
    groups = {}
    for info in result["groups"]:
        rs = {r["step"]: r["ms"] for r in result["rows"] if r["group"] == info["group"]}
        groups[info["group"]] = {
            "AG stock": rs[AG_STOCK],
            "AG TIDE": min(v for k, v in rs.items()
                           if k.startswith("AG TIDE") and k.endswith(f", {info['exec_lanes']} lane(s)")),
        }
        if info.get("rs", True):
            groups[info["group"]].update({"RS stock": rs[RS_STOCK], "RS TIDE (solver CTAs)": rs[RS_TIDE],
                                          "RS TIDE (full grid)": rs[RS_FULL]})
    bar_plot(path, f"tide bench layout: {result['device']}, N = {result['ranks']} virtual ranks on one GPU "
             "(lower is better)", groups, "ms per call")


if __name__ == "__main__":
    sys.exit(main())
