"""CUDA kernel unit tests (SUM, LAND, CAST, ZERO), copy paths, stream memops and the watchdog.

Run on the GPU machine (tools/gpu_check.sh). Every output is poisoned before the launch and
compared bit for bit with a CPU fp32 reference of the same association, and with an fp64
reference within tolerance. Fresh random data for every case; never zeros.
"""
import pytest

torch = pytest.importorskip("torch")
from tide import _core  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _stream():
    return torch.cuda.current_stream().cuda_stream


def _bits_equal(a, b):
    return torch.equal(a.contiguous().view(torch.int32).cpu(), b.contiguous().view(torch.int32).cpu())


def _segments(param_lens, n_pad_between, gen):
    """Own-contribution segments: each parameter piece followed by zero padding."""
    rows, grads, off = [], [], 0
    for p, ln in enumerate(param_lens):
        src_off = int(torch.randint(0, 9, (1,), generator=gen))
        g = torch.randn(src_off + ln + 3, generator=gen).to(torch.bfloat16).to(DEV)
        grads.append(g)
        rows.append((off, ln, src_off, p))
        off += ln
        if n_pad_between:
            rows.append((off, n_pad_between, 0, -1))
            off += n_pad_between
    return rows, grads, off


def _seg_table(rows):
    t = torch.tensor([[d, ln, s, p & 0xFFFFFFFF] for d, ln, s, p in rows], dtype=torch.int64)
    return t.to(DEV)


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
@pytest.mark.parametrize("shape", ["aligned", "ragged"])
def test_sum_bitwise(n_staged, shape):
    gen = torch.Generator().manual_seed(100 + n_staged)
    lens = [4096, 1024, 8, 24576] if shape == "aligned" else [1000, 3, 77, 4099]
    pad = 8 if shape == "aligned" else 5
    rows, grads, n = _segments(lens, pad, gen)
    staged = [torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(n_staged)]
    ref, ref64 = _sum_reference(staged, rows, grads, n)
    table = _seg_table(rows)
    outs = []
    for ctas in (1, 3, 16, 132):
        dst = torch.full((n,), float("nan"), device=DEV)
        _core.cuda_sum(dst.data_ptr(), n, [s.data_ptr() for s in staged], table.data_ptr(), len(rows),
                       [g.data_ptr() for g in grads], ctas, _stream())
        torch.cuda.synchronize()
        assert not torch.isnan(dst).any(), f"unwritten elements at ctas={ctas}"
        assert _bits_equal(dst, ref), f"SUM differs from the CPU fp32 reference at ctas={ctas}"
        outs.append(dst)
    err = (outs[0].double().cpu() - ref64).norm() / max(ref64.norm(), 1e-30)
    assert err < 1e-6


@pytest.mark.parametrize("n_src", [1, 2, 8])
@pytest.mark.parametrize("accumulate", [False, True])
def test_land_bitwise(n_src, accumulate):
    gen = torch.Generator().manual_seed(7 * n_src + accumulate)
    lens = [4096, 13, 1 << 16]
    alpha = 0.125 if accumulate else 1.0 / 3.0
    jobs, refs, dsts = [], [], []
    for n in lens:
        srcs = [torch.randn(n, generator=gen).to(DEV) for _ in range(n_src)]
        prev = torch.randn(n, generator=gen)
        dst = prev.to(DEV) if accumulate else torch.full((n,), float("nan"), device=DEV)
        t = srcs[0].cpu()
        for s in srcs[1:]:
            t = t + s.cpu()
        v = torch.tensor(alpha, dtype=torch.float32) * t
        refs.append(prev + v if accumulate else v)
        jobs.append((dst.data_ptr(), [s.data_ptr() for s in srcs], n))
        dsts.append((dst, srcs))
    _core.cuda_land(jobs, alpha, accumulate, 5, _stream())
    torch.cuda.synchronize()
    for (dst, _), ref in zip(dsts, refs):
        assert _bits_equal(dst, ref)


def test_cast_rne():
    gen = torch.Generator().manual_seed(3)
    for n in (1 << 20, 1001):
        src = (torch.randn(n, generator=gen) * 1e3).to(DEV)
        dst = torch.full((n,), -1, dtype=torch.int16, device=DEV)
        _core.cuda_cast(dst.data_ptr(), src.data_ptr(), n, 64, _stream())
        torch.cuda.synchronize()
        ref = src.to(torch.bfloat16).view(torch.int16)
        assert torch.equal(dst, ref)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38], device=DEV)
    dst = torch.zeros(6, dtype=torch.int16, device=DEV)
    _core.cuda_cast(dst.data_ptr(), special.data_ptr(), 6, 1, _stream())
    torch.cuda.synchronize()
    got = [int(x) & 0xFFFF for x in dst.cpu()]
    assert got[0] == 0x7FC0 and got[1] == 0x7F80 and got[2] == 0xFF80 and got[3] == 0x8000


def test_zero_regions():
    buf = torch.full((1 << 20,), 0x5A, dtype=torch.uint8, device=DEV)
    regions = [(0, 4096), (4099, 17), (10000, 65536 + 3), (900001, 1)]
    _core.cuda_zero([(buf.data_ptr() + o, b) for o, b in regions], 8, _stream())
    torch.cuda.synchronize()
    ref = torch.full((1 << 20,), 0x5A, dtype=torch.uint8)
    for o, b in regions:
        ref[o:o + b] = 0
    assert torch.equal(buf.cpu(), ref)


@pytest.mark.parametrize("capture", ["default_stream", "side_stream", "graph"])
def test_copies_1d_2d(capture):
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device=DEV)
    dst = torch.full((1 << 21,), 7, dtype=torch.uint8, device=DEV)
    s, d = src.data_ptr(), dst.data_ptr()
    descs = [(d + 0, s + 0, 4096, 1, 0, 0), (d + 8192, s + 100, 999, 1, 0, 0),
             (d + 100000, s + 5000, 64, 16, 256, 100)]  # strided landing: 16 rows of 64 bytes
    ref = torch.full((1 << 21,), 7, dtype=torch.uint8)
    sc = src.cpu()
    ref[0:4096] = sc[0:4096]
    ref[8192:8192 + 999] = sc[100:1099]
    for r in range(16):
        ref[100000 + 256 * r:100000 + 256 * r + 64] = sc[5000 + 100 * r:5000 + 100 * r + 64]
    if capture == "graph":
        stream = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            assert _core.cuda_is_capturing(torch.cuda.current_stream().cuda_stream)
            _core.cuda_copies(descs, torch.cuda.current_stream().cuda_stream)
        g.replay()
    elif capture == "side_stream":  # eager batch path (cudaMemcpyBatchAsync)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        _core.cuda_copies(descs, side.cuda_stream)
        side.synchronize()
    else:
        _core.cuda_copies(descs, _stream())
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), ref)


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
        _core.cuda_signal(counter.data_ptr(), epoch, prod.cuda_stream)
    with torch.cuda.stream(cons):
        _core.cuda_wait([(counter.data_ptr(), epoch)], cons.cuda_stream)
        out.copy_(data)
    torch.cuda.synchronize()
    assert torch.all(out == 3.0)
    assert int(counter.item()) == epoch


def test_watchdog_timeout_names_the_wait():
    counter = torch.zeros(1, dtype=torch.int64, device=DEV)
    wd = _core.CudaWatchdog(0, 0.5)
    s = torch.cuda.Stream()
    wd.wait([(counter.data_ptr(), 1)], "rank 3 op 7 (WAIT) seq 2", s.cuda_stream)
    with pytest.raises(TimeoutError, match="rank 3 op 7 .* seq 2"):
        wd.drain()
    s.synchronize()  # released: the stream drains instead of hanging
    del wd


def test_watchdog_quiet_when_signalled():
    counter = torch.zeros(1, dtype=torch.int64, device=DEV)
    wd = _core.CudaWatchdog(0, 5.0)
    s, p = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(p):  # producer first: see [Note: producer first]
        torch.cuda._sleep(2_000_000)
        _core.cuda_signal(counter.data_ptr(), 2, p.cuda_stream)
    wd.wait([(counter.data_ptr(), 2)], "rank 0 op 1 seq 1", s.cuda_stream)
    wd.drain()
    wd.check()


def test_multicast_gate_closed_here():
    import os
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0"
    assert _core.cuda_multicast_allowed(0) is False


def test_capability_probe():
    caps = _core.cuda_capabilities(0)
    assert caps["memops64"], "64-bit stream memory operations are required for signals/waits"
    assert caps["multicast_allowed"] is False  # the gate is closed on the test machines
    assert caps["sm_count"] > 0 and caps["async_engines"] >= 1
