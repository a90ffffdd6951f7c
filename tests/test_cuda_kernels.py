"""CUDA kernel unit tests (SUM, REDUCE: the executors' SUM and LAND; CAST, ZERO), copy paths,
stream memops, watchdog.

Run on the GPU machine (python3 tools/gpu/run.py kernels). Every output is poisoned before the
launch and compared bit for bit with a CPU fp32 reference of the same association, and with an
fp64 reference within tolerance. Fresh random data for every case; never zeros. SUM and REDUCE
run under every CTA work split (ExecutorOptions.cta_split): all must give the same bits.
"""
import pytest

torch = pytest.importorskip("torch")
from tide import _core  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
SPLITS = ["auto", "ranges", "tiles"]  # auto: ranges below 32 CTAs, tiles from there


@pytest.fixture(params=SPLITS)
def split(request):
    """The executor options a launch follows: the CTA work split (device.cuh)."""
    return {"cta_split": request.param}


def _stream():
    return torch.cuda.current_stream().cuda_stream


def _bits_equal(a, b):
    return torch.equal(a.contiguous().view(torch.int32).cpu(), b.contiguous().view(torch.int32).cpu())


def _segments(param_lens, n_pad_between, gen, src_offs=None):
    """Own-contribution segments: each parameter piece followed by zero padding."""
    rows, grads, off = [], [], 0
    for p, ln in enumerate(param_lens):
        src_off = int(torch.randint(0, 9, (1,), generator=gen)) if src_offs is None else src_offs[p]
        g = torch.randn(src_off + ln + 3, generator=gen).to(torch.bfloat16).to(DEV)
        grads.append(g)
        rows.append((off, ln, src_off, p))
        off += ln
        if n_pad_between:
            rows.append((off, n_pad_between, 0, -1))
            off += n_pad_between
    return rows, grads, off


def _seg_table(rows):
    """SUM's segment table on the GPU (the core packs its records)."""
    return _core.cuda.sum_segments(rows)


def _sum_reference(staged, rows, grads, n):
    own = torch.zeros(n, dtype=torch.float32)
    covered = torch.zeros(n, dtype=torch.bool)
    for d, ln, s, p in rows:
        if p >= 0:
            own[d:d + ln] = grads[p][s:s + ln].float().cpu()
            covered[d:d + ln] = True
    if not staged:
        return own, own.double()
    acc = staged[0].float().cpu()
    for x in staged[1:]:
        acc = acc + x.float().cpu()
    acc = torch.where(covered, acc + own, acc)  # an absent own term is skipped (CPU executor)
    ref64 = sum(x.double().cpu() for x in staged) + own.double()
    return acc, ref64


@pytest.mark.parametrize("n_staged", [0, 1, 3, 7])
@pytest.mark.parametrize("shape", ["aligned", "ragged", "long"])
def test_sum_bitwise(n_staged, shape, split):
    gen = torch.Generator().manual_seed(100 + n_staged)
    # "long": segments of many bulk chunks, so the ring (6 stages) wraps several times per CTA.
    lens = {"aligned": [4096, 1024, 8, 24576], "ragged": [1000, 3, 77, 4099],
            "long": [200_000, 5, 123_457, 64]}[shape]
    pad = {"aligned": 8, "ragged": 5, "long": 13}[shape]
    # "long": own offsets with dst_off - src_off = 0 mod 8 for both long segments (dst_off 0 and
    # 200_031), so they take the vector/bulk body; the short ones stay scalar.
    rows, grads, n = _segments(lens, pad, gen, [0, 3, 7, 5] if shape == "long" else None)
    if shape == "long":
        assert [(d - s) % 8 for d, _, s, p in rows if p in (0, 2)] == [0, 0]
    staged = [torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(n_staged)]
    ref, ref64 = _sum_reference(staged, rows, grads, n)
    table = _seg_table(rows)
    outs = []
    for ctas in (1, 3, 16, 132):
        dst = torch.full((n,), float("nan"), device=DEV)
        _core.cuda.sum(dst.data_ptr(), n, [s.data_ptr() for s in staged], table.ptr, len(rows),
                       [g.data_ptr() for g in grads], ctas, _stream(), split)
        torch.cuda.synchronize()
        assert not torch.isnan(dst).any(), f"unwritten elements at ctas={ctas}"
        assert _bits_equal(dst, ref), f"SUM differs from the CPU fp32 reference at ctas={ctas}"
        outs.append(dst)
    err = (outs[0].double().cpu() - ref64).norm() / max(ref64.norm(), 1e-30)
    assert err < 1e-6


# ---- special values and NaN-aware bitwise comparison --------------------------------------------
POISON = 0x7F80DEAD  # a signalling-NaN pattern no kernel produces: marks unwritten elements


def _poisoned(n):
    return torch.full((n,), POISON, dtype=torch.int32, device=DEV).view(torch.float32)


def _assert_same(got, ref, what):
    """Bitwise equal, except that NaN payloads may differ (IEEE adds do not keep them)."""
    g = got.cpu().contiguous()
    r = ref.contiguous()
    gi, ri = g.view(torch.int32), r.view(torch.int32)
    assert not (gi == POISON).any(), f"{what}: {(gi == POISON).sum().item()} elements unwritten"
    gn, rn = torch.isnan(g), torch.isnan(r)
    assert torch.equal(gn, rn), f"{what}: NaN positions differ ({(gn != rn).sum().item()} elements)"
    bad = (gi != ri) & ~gn
    if bad.any():
        k = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements differ; first at {k}: "
                             f"got {g[k].item()!r} ({gi[k].item() & 0xFFFFFFFF:#010x}), "
                             f"want {r[k].item()!r} ({ri[k].item() & 0xFFFFFFFF:#010x})")


def _specials(x, gen, frac=0.01):
    """Overwrite ~frac of x (CPU fp32 or bf16) with NaN, +-Inf, +-0.0 and the smallest subnormal."""
    n = x.numel()
    vals = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                         1e-40 if x.dtype == torch.float32 else 9.2e-41], dtype=torch.float32).to(x.dtype)
    idx = torch.randint(0, n, (max(1, int(n * frac)),), generator=gen)
    x[idx] = vals[torch.randint(0, len(vals), (idx.numel(),), generator=gen)]
    return x


def test_sum_specials_and_negative_zero(split):
    """NaN/Inf/-0.0 in staged and own terms; at some elements every term is -0.0 (result -0.0:
    the first term initialises, nothing is added to a +0.0 start) or +0.0 and -0.0 mix (+0.0)."""
    gen = torch.Generator().manual_seed(77)
    n_staged = 7
    rows, grads, n = _segments([50_000, 7, 30_001], 9, gen, [0, 1, 8])
    staged_cpu = [_specials(torch.randn(n, generator=gen).to(torch.bfloat16), gen) for _ in range(n_staged)]
    grads_cpu = [_specials(g.cpu(), gen) for g in grads]
    neg = torch.randint(0, n, (500,), generator=gen)
    mix = torch.randint(0, n, (500,), generator=gen)
    for x in staged_cpu:
        x[neg] = -0.0
        x[mix] = -0.0
    staged_cpu[3][mix] = 0.0
    for d, ln, src, p in rows:
        if p >= 0:
            sel = neg[(neg >= d) & (neg < d + ln)]
            grads_cpu[p][sel - d + src] = -0.0
    staged = [x.to(DEV) for x in staged_cpu]
    grads = [g.to(DEV) for g in grads_cpu]
    ref, _ = _sum_reference(staged, rows, grads, n)
    assert (ref[neg].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).sum() > 100
    table = _seg_table(rows)
    for ctas in (1, 7, 132):
        dst = _poisoned(n)
        _core.cuda.sum(dst.data_ptr(), n, [x.data_ptr() for x in staged], table.ptr, len(rows),
                       [g.data_ptr() for g in grads], ctas, _stream(), split)
        torch.cuda.synchronize()
        _assert_same(dst, ref, f"SUM ({split['cta_split']}) with special values at ctas={ctas}")


def test_sum_captured_in_graph(split):
    """SUM launched inside a CUDA graph capture (as the executor's captured programs do) and
    replayed twice: same bits as the CPU reference. n_staged = 5 appears in no other test, so
    the capture holds that kernel's first launch (lazy module loading under capture)."""
    gen = torch.Generator().manual_seed(55)
    rows, grads, n = _segments([100_000, 77, 20_000], 8, gen, [0, 1, 8])
    staged = [torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(5)]
    ref, _ = _sum_reference(staged, rows, grads, n)
    table = _seg_table(rows)
    dst = _poisoned(n)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        _core.cuda.sum(dst.data_ptr(), n, [x.data_ptr() for x in staged], table.ptr, len(rows),
                       [g.data_ptr() for g in grads], 4, torch.cuda.current_stream().cuda_stream, split)
    for _ in range(2):
        dst.view(torch.int32).fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(dst, ref, f"SUM ({split['cta_split']}) replayed from a CUDA graph")


# ---- REDUCE: the executor's run-table kernel (SUM and LAND), through cuda.reduce -----------------
MAX_TERMS = 12


def _pack_runs(runs):
    """REDUCE's run table on the GPU (the core packs its ReduceRun records)."""
    table = _core.cuda.reduce_runs(runs)
    assert table.count == len(runs)
    return table


def _reduce_case(n_terms, dtypes, gen):
    """Terms (one buffer per term, bf16 or fp32, specials sprinkled) and runs covering [0, n):
    long 8-aligned runs (the vector/bulk body, several bulk chunks), runs whose terms are
    misaligned to each other (scalar), short runs, a run with absent terms and one with none."""
    sizes = [4 if dt == torch.float32 else 2 for dt in dtypes]
    cap = 160_000
    bufs = [_specials(torch.randn(cap, generator=gen).to(dt), gen) for dt in dtypes]
    plan = [("aligned", 70_001, "all"), ("misaligned", 1_003, "all"), ("aligned", 8, "all"),
            ("aligned", 5, "all"), ("aligned", 777, "none"), ("aligned", 40_000, "some"),
            ("misaligned", 12_345, "some"), ("aligned", 20_000, "all"), ("aligned", 3, "first")]
    runs, d0 = [], 0
    for kind, ln, present in plan:
        terms = []
        for i in range(n_terms):
            on = (present == "all" or (present == "some" and (i % 3 != 1 or n_terms == 1))
                  or (present == "first" and i == 0))
            if not on:
                terms.append(None)
                continue
            s = int(torch.randint(0, cap - ln - 16, (1,), generator=gen))
            if kind == "aligned":
                s = s - (s % 8) + (d0 % 8)  # element d0 of dst <-> element s: same phase mod 8
            else:
                s = s - (s % 8) + (d0 + 1 + i) % 8
            terms.append((i, s * sizes[i]))
        runs.append((d0, ln, terms))
        d0 += ln
    return bufs, runs, d0


def _reduce_reference(bufs, runs, n, land, accumulate, alpha, old):
    out = torch.zeros(n, dtype=torch.float32)
    for d0, ln, terms in runs:
        t = None
        for i, term in enumerate(terms):
            if term is None:
                continue
            s = term[1] // bufs[i].element_size()
            x = bufs[i][s:s + ln].float()
            t = x.clone() if t is None else t + x  # the first present term initialises
        out[d0:d0 + ln] = 0.0 if t is None else t
    if land:
        v = torch.tensor(alpha, dtype=torch.float32) * out
        out = old + v if accumulate else v
    return out


@pytest.mark.parametrize("n_terms", list(range(1, MAX_TERMS + 1)))
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "mixed"])
@pytest.mark.parametrize("op", ["sum", "land", "land_accumulate"])
def test_reduce_bitwise(n_terms, dtype, op, split):
    gen = torch.Generator().manual_seed(1000 * n_terms + 10 * len(dtype) + len(op))
    dtypes = {"bf16": [torch.bfloat16] * n_terms, "fp32": [torch.float32] * n_terms,
              "mixed": [torch.float32 if i % 2 else torch.bfloat16 for i in range(n_terms)]}[dtype]
    mask = sum(1 << i for i, dt in enumerate(dtypes) if dt == torch.float32)
    bufs, runs, n = _reduce_case(n_terms, dtypes, gen)
    land, accumulate = op != "sum", op == "land_accumulate"
    alpha = 0.125 if accumulate else 1.0 / 3.0
    old = _specials(torch.randn(n, generator=gen), gen)
    ref = _reduce_reference(bufs, runs, n, land, accumulate, alpha, old)
    dev_bufs = [b.to(DEV) for b in bufs]
    table = _pack_runs(runs)
    for ctas in (1, 5, 132):
        dst = old.to(DEV) if accumulate else _poisoned(n)
        _core.cuda.reduce(dst.data_ptr(), n, table.ptr, len(runs), n_terms, mask, land, accumulate,
                          alpha, [b.data_ptr() for b in dev_bufs], ctas, _stream(), split)
        torch.cuda.synchronize()
        _assert_same(dst, ref, f"REDUCE {op} ({split['cta_split']}, {n_terms} {dtype} terms) at ctas={ctas}")


def test_reduce_unaligned_dst(split):
    """dst 4 bytes off a 16-byte boundary: no vector/bulk body anywhere, same bits."""
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.bfloat16] * 8
    bufs, runs, n = _reduce_case(8, dtypes, gen)
    ref = _reduce_reference(bufs, runs, n, False, False, 1.0, None)
    dev_bufs = [b.to(DEV) for b in bufs]
    table = _pack_runs(runs)
    base = _poisoned(n + 4)
    _core.cuda.reduce(base.data_ptr() + 4, n, table.ptr, len(runs), 8, 0, False, False, 1.0,
                      [b.data_ptr() for b in dev_bufs], 3, _stream(), split)
    torch.cuda.synchronize()
    _assert_same(base[1:n + 1], ref, f"REDUCE ({split['cta_split']}) into an unaligned dst")
    assert base[0].view(torch.int32).item() == POISON and base[n + 1].view(torch.int32).item() == POISON


def test_sum_kernels_do_not_spill():
    attrs = _core.cuda.kernel_attrs()
    names = {a["name"] for a in attrs}
    assert {"sum_kernel<7>", "reduce_kernel<12>", "reduce_kernel<12,fp32>", "reduce_kernel<12,mixed>"} <= names
    spilled = [a for a in attrs if a["local_bytes"] != 0]
    assert not spilled, f"kernels with local memory (spills or stack): {spilled}"


def test_cast_rne():
    gen = torch.Generator().manual_seed(3)
    for n in (1 << 20, 1001):
        src = (torch.randn(n, generator=gen) * 1e3).to(DEV)
        dst = torch.full((n,), -1, dtype=torch.int16, device=DEV)
        _core.cuda.cast(dst.data_ptr(), src.data_ptr(), n, 64, _stream())
        torch.cuda.synchronize()
        ref = src.to(torch.bfloat16).view(torch.int16)
        assert torch.equal(dst, ref)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38], device=DEV)
    dst = torch.zeros(6, dtype=torch.int16, device=DEV)
    _core.cuda.cast(dst.data_ptr(), special.data_ptr(), 6, 1, _stream())
    torch.cuda.synchronize()
    got = [int(x) & 0xFFFF for x in dst.cpu()]
    assert got[0] == 0x7FC0 and got[1] == 0x7F80 and got[2] == 0xFF80 and got[3] == 0x8000


def test_zero_regions():
    buf = torch.full((1 << 20,), 0x5A, dtype=torch.uint8, device=DEV)
    regions = [(0, 4096), (4099, 17), (10000, 65536 + 3), (900001, 1)]
    _core.cuda.zero([(buf.data_ptr() + o, b) for o, b in regions], 8, _stream())
    torch.cuda.synchronize()
    ref = torch.full((1 << 20,), 0x5A, dtype=torch.uint8)
    for o, b in regions:
        ref[o:o + b] = 0
    assert torch.equal(buf.cpu(), ref)


@pytest.mark.parametrize("mode_2d", ["batch", "per_copy"])
@pytest.mark.parametrize("capture", ["default_stream", "side_stream", "graph"])
def test_copies_1d_2d(capture, mode_2d):
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device=DEV)
    dst = torch.full((1 << 21,), 7, dtype=torch.uint8, device=DEV)
    s, d = src.data_ptr(), dst.data_ptr()
    descs = [(d + 0, s + 0, 4096, 1, 0, 0), (d + 8192, s + 100, 999, 1, 0, 0),
             (d + 100000, s + 5000, 64, 16, 256, 100),  # strided landing: 16 rows of 64 bytes
             (d + 1100000, s + 10000, 300 << 10, 3, 320 << 10, 310 << 10)]  # wide strided rows
    ref = torch.full((1 << 21,), 7, dtype=torch.uint8)
    sc = src.cpu()
    ref[0:4096] = sc[0:4096]
    ref[8192:8192 + 999] = sc[100:1099]
    for r in range(16):
        ref[100000 + 256 * r:100000 + 256 * r + 64] = sc[5000 + 100 * r:5000 + 100 * r + 64]
    for r in range(3):
        ref[1100000 + (320 << 10) * r:1100000 + (320 << 10) * r + (300 << 10)] = \
            sc[10000 + (310 << 10) * r:10000 + (310 << 10) * r + (300 << 10)]
    if capture == "graph":
        stream = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            assert _core.cuda.is_capturing(torch.cuda.current_stream().cuda_stream)
            _core.cuda.copies(descs, torch.cuda.current_stream().cuda_stream, copy_2d=mode_2d)
        g.replay()
    elif capture == "side_stream":  # eager batch paths (cudaMemcpyBatchAsync, cudaMemcpy3DBatchAsync)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        _core.cuda.copies(descs, side.cuda_stream, copy_2d=mode_2d)
        side.synchronize()
    else:
        _core.cuda.copies(descs, _stream(), copy_2d=mode_2d)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), ref)


@pytest.mark.parametrize("ctas", [1, 16])
@pytest.mark.parametrize("capture", [False, True])
def test_copies_on_sms(capture, ctas):
    """[Note: copies on SMs]: 60 copies (more than one launch holds), 1-D and strided, at offsets
    and widths that give every unit (16, 8, 4, 2, 1 bytes) and rows narrower than the grid's
    stride; bytes outside the copies keep their poison."""
    gen = torch.Generator().manual_seed(ctas)
    n = 8 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen).to(DEV)
    dst = torch.full((n,), 7, dtype=torch.uint8, device=DEV)
    s, d = src.data_ptr(), dst.data_ptr()
    ref = torch.full((n,), 7, dtype=torch.uint8)
    sc = src.cpu()
    descs, off, units = [], 0, set()
    for i in range(60):
        unit = (16, 8, 4, 2, 1)[i % 5]
        w = unit * int(torch.randint(1, 4096, (1,), generator=gen)) if i % 7 else unit * 3
        h = 1 if i % 3 else int(torch.randint(2, 40, (1,), generator=gen))
        dp, sp = (w + 16 * (i % 4), w + unit * (i % 3)) if h > 1 else (0, 0)
        so = off + (unit if unit < 16 else 0)
        descs.append((d + off, s + so, w, h, dp, sp))
        for r in range(h):
            ref[off + r * dp:off + r * dp + w] = sc[so + r * sp:so + r * sp + w]
        units.add(_core.cuda.sm_copy_unit(d + off, s + so, w, h, dp, sp))
        off += (h - 1) * max(dp, sp) + w + 64
        off += -off % 16
    assert off <= n and units == {16, 8, 4, 2, 1}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    if capture:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            _core.cuda.copies(descs, side.cuda_stream, sm_ctas=ctas)
        g.replay()
    else:
        _core.cuda.copies(descs, side.cuda_stream, sm_ctas=ctas)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), ref)


@pytest.mark.parametrize("lanes", [2, 4])
@pytest.mark.parametrize("capture", [False, True])
def test_copies_spread_over_lanes(lanes, capture):
    """[Note: copy lanes]: 40 copies (1-D and strided, 24 MiB) over `lanes` streams forked from the
    caller's; the caller's NEXT op reads the destination, so a missing join shows as stale bytes."""
    gen = torch.Generator().manual_seed(lanes)
    n = 24 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen).to(DEV)
    dst = torch.full((n,), 7, dtype=torch.uint8, device=DEV)
    after = torch.empty_like(dst)
    s, d = src.data_ptr(), dst.data_ptr()
    ref = torch.full((n,), 7, dtype=torch.uint8)
    sc = src.cpu()
    descs, off = [], 0
    for i in range(40):
        w = int(torch.randint(1, 1 << 19, (1,), generator=gen))
        if i % 3 == 0:  # strided: 2 rows, destination pitch 2w
            descs.append((d + off, s + off, w, 2, 2 * w, 2 * w))
            ref[off:off + w] = sc[off:off + w]
            ref[off + 2 * w:off + 3 * w] = sc[off + 2 * w:off + 3 * w]
            off += 4 * w
        else:
            descs.append((d + off, s + off, w, 1, 0, 0))
            ref[off:off + w] = sc[off:off + w]
            off += w + 64
    assert off <= n and sum(w * h for _, _, w, h, _, _ in descs) >= 8 << 20  # above the spread threshold
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    if capture:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            _core.cuda.copies(descs, side.cuda_stream, lanes)
            after.copy_(dst)
        g.replay()
    else:
        with torch.cuda.stream(side):
            _core.cuda.copies(descs, side.cuda_stream, lanes)
            after.copy_(dst)  # same stream, right after: must see every lane's bytes
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), ref)
    assert torch.equal(after.cpu(), ref)


def test_signal_wait_orders_streams():
    counter = torch.zeros(1, dtype=torch.int64, device=DEV)
    data = torch.zeros(1 << 20, device=DEV)
    out = torch.full((1 << 20,), float("nan"), device=DEV)
    prod, cons = torch.cuda.Stream(), torch.cuda.Stream()
    epoch = 5
    # [Note: producer first] A stream wait enqueued before its producer can sit in the hardware
    # queue the producer's stream maps to and never let it run (seen on the H200 on 2026-11-29:
    # this test hung when written consumer-first). The executor enqueues every wait after its
    # producer; so does this test. The producer sleeps, so the consumer still really waits.
    with torch.cuda.stream(prod):
        torch.cuda._sleep(2_000_000)
        data.fill_(3.0)
        _core.cuda.signal(counter.data_ptr(), epoch, prod.cuda_stream)
    with torch.cuda.stream(cons):
        _core.cuda.wait([(counter.data_ptr(), epoch)], cons.cuda_stream)
        out.copy_(data)
    torch.cuda.synchronize()
    assert torch.all(out == 3.0)
    assert int(counter.item()) == epoch


def test_watchdog_timeout_names_the_wait():
    counter = torch.zeros(1, dtype=torch.int64, device=DEV)
    wd = _core.cuda.Watchdog(0, 0.5)
    s = torch.cuda.Stream()
    wd.wait([(counter.data_ptr(), 1)], "rank 3 op 7 (WAIT) seq 2", s.cuda_stream)
    with pytest.raises(TimeoutError, match="rank 3 op 7 .* seq 2"):
        wd.drain()
    s.synchronize()  # released: the stream drains instead of hanging
    del wd


def test_watchdog_quiet_when_signalled():
    counter = torch.zeros(1, dtype=torch.int64, device=DEV)
    wd = _core.cuda.Watchdog(0, 5.0)
    s, p = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(p):  # producer first: see [Note: producer first]
        torch.cuda._sleep(2_000_000)
        _core.cuda.signal(counter.data_ptr(), 2, p.cuda_stream)
    wd.wait([(counter.data_ptr(), 2)], "rank 0 op 1 seq 1", s.cuda_stream)
    wd.drain()
    wd.check()


def test_multicast_gate_closed_here():
    import os
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0"
    assert _core.cuda.multicast_allowed(0) is False


def test_capability_probe():
    caps = _core.cuda.capabilities(0)
    assert caps["memops64"], "64-bit stream memory operations are required for signals/waits"
    assert caps["multicast_allowed"] is False  # the gate is closed on the test machines
    assert caps["sm_count"] > 0 and caps["async_engines"] >= 1


def _launched_grids(fn, name, tmp_path):
    """Grid x of every kernel whose name contains `name` that fn() launches (torch profiler)."""
    import json
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text()).get("traceEvents", [])
    return [e["args"]["grid"][0] for e in events if e.get("cat") == "kernel" and name in e.get("name", "")]


@pytest.mark.parametrize("full_grid", ["tiles", "wave"])
def test_full_grid_one_cta_per_tile(full_grid, tmp_path):
    """kernels.h [Note: full grid]: a budget of one whole resident wave runs one short-lived CTA
    per tile (ExecutorOptions.full_grid="tiles", default) or exactly the budget ("wave"); SUM and
    REDUCE (the executors' SUM and LAND) give the reference's bits either way, every element
    written."""
    opts = {"full_grid": full_grid}
    gen = torch.Generator().manual_seed(11 if full_grid == "tiles" else 12)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wave = lambda kernel, k: sms * max(1, _core.cuda.resident_ctas_per_sm(kernel, k))
    n = 5_000_003  # more tiles than one wave of every kernel below
    alpha = 1.0 / 3.0

    def check_grid(run, name, budget, tiles=None):
        grids = _launched_grids(run, name, tmp_path)
        assert len(grids) == 1, grids
        if full_grid == "wave":
            assert grids[0] == budget, (grids, budget)
        elif tiles is not None:
            assert grids[0] == tiles, (grids, tiles)
        else:
            assert grids[0] > budget, (grids, budget)

    # SUM: 7 staged slices + own segments.
    rows, grads, m = _segments([3_000_000, 5, 2_000_000], 13, gen, [0, 3, 5])
    staged = [torch.randn(m, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(7)]
    ref, _ = _sum_reference(staged, rows, grads, m)
    table = _seg_table(rows)
    out = _poisoned(m)
    budget = wave("sum", 7)
    check_grid(lambda: _core.cuda.sum(out.data_ptr(), m, [s.data_ptr() for s in staged], table.ptr, len(rows),
                                      [g.data_ptr() for g in grads], budget, _stream(), opts), "sum_kernel", budget)
    _assert_same(out, ref, f"SUM, full_grid={full_grid}")

    # REDUCE: LAND of one fp32 term (the executors' LAND) and a SUM of 8 bf16 terms.
    for dtype, terms, land in ((torch.float32, 1, True), (torch.bfloat16, 8, False)):
        bufs = [torch.randn(n, generator=gen).to(dtype) for _ in range(terms)]
        dev_bufs = [b.to(DEV) for b in bufs]
        runs = [(0, n, [(i, 0) for i in range(terms)])]
        table = _pack_runs(runs)
        ref = _reduce_reference(bufs, runs, n, land, False, alpha, None)
        out = _poisoned(n)
        budget = wave("reduce_fp32" if land else "reduce", terms)
        check_grid(lambda: _core.cuda.reduce(out.data_ptr(), n, table.ptr, 1, terms,
                                             (1 << terms) - 1 if land else 0, land, False, alpha,
                                             [b.data_ptr() for b in dev_bufs], budget, _stream(), opts),
                   "reduce_kernel", budget)
        _assert_same(out, ref, f"REDUCE {terms} {dtype} terms, full_grid={full_grid}")
