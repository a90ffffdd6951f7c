"""fp16 in the core (layout.cc [Note: dtypes], tide/numerics.h): the all-gather's CAST from fp32
shards to fp16 rounds as torch's ``.to(torch.float16)``, bit for bit, and TIDE-RS reads fp16
gradients (staged slices, own terms), widened exactly and summed in fp32. CPU virtual cluster;
the ``gpu`` tests run the same programs on the CUDA one and compare bit for bit."""
import numpy as np
import pytest

import tide

torch = pytest.importorskip("torch")

SHAPES = [(37, 16), (5,), (64, 3, 8), (9, 40), (3, 7)]
CONFIGS = [(1, 1), (1, 4), (2, 2), (3, 2)]


def _rows(plan, r, p):
    pl = plan.layout.params[p]
    return max(0, min(pl.R, pl.D - r * pl.R))


def _cast_cases(n, seed):
    """fp32 values that exercise fp32 -> fp16 rounding: normals, fp16 subnormals and the
    underflow boundary, ties at every scale, overflow to inf, infinities, signed zeros."""
    rng = np.random.default_rng(seed)
    pick = [
        rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n),   # every fp16 range
        rng.uniform(-2.0 ** -14, 2.0 ** -14, n),                    # fp16 subnormals
        np.float32(2.0 ** -25) * rng.integers(-3, 4, n),            # the underflow ties
        np.float16(rng.standard_normal(n)).astype(np.float32)
        * np.float32(1 + 2.0 ** -11),                               # ties of normals
        rng.uniform(65504.0, 65536.0, n) * rng.choice([-1, 1], n),  # largest finite / overflow
        np.array([np.inf, -np.inf, 0.0, -0.0, 65504.0, 65519.99, 65520.0, 2.0 ** -24, 2.0 ** -25]),
    ]
    vals = np.concatenate(pick).astype(np.float32)
    return np.resize(vals, n)


def _fp16_ref(x32: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x32)).to(torch.float16).numpy()


def _cast_shards(plan, world, seed):
    shapes = plan.shapes
    out = []
    for r in range(world):
        row = []
        for p in range(plan.layout.P):
            k = int(np.prod(shapes[p][1:])) if len(shapes[p]) > 1 else 1
            row.append(_cast_cases(_rows(plan, r, p) * k, seed * 100 + r * 10 + p))
        out.append(row)
    return out


@pytest.mark.parametrize("M,L", CONFIGS)
def test_fp16_cast_all_gather_rounds_as_torch(M, L):
    topo = tide.Topology(M, L)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, ag_dtype="float16", shard_dtype="float32"), topo)
    assert (plan.ag_dtype, plan.shard_dtype) == ("float16", "float32")
    vc = tide.VirtualCluster(topo)  # checked programs
    shards = _cast_shards(plan, topo.world, M * 10 + L)
    full = vc.all_gather(plan, shards)
    for r in range(topo.world):
        for p in range(plan.layout.P):
            got = np.ascontiguousarray(full[r][p]).reshape(-1)
            assert got.dtype == np.float16
            want = _fp16_ref(np.concatenate([s[p] for s in shards]))
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (r, p)


def test_cast_pairs_the_planner_refuses():
    topo = tide.Topology(1, 2)
    for ag, shard in (("float32", "bfloat16"), ("bfloat16", "float16"), ("float16", "bfloat16")):
        with pytest.raises(tide.PlanError, match=r"GroupSignature\.shard_dtype: .*float32 shards"):
            tide.plan(tide.GroupSignature(shapes=SHAPES, ag_dtype=ag, shard_dtype=shard), topo)


def _fp16_grads(plan, world, rng, kind):
    out = []
    for _ in range(world):
        if kind == "int":
            out.append([rng.integers(-64, 64, size=s).astype(np.float16) for s in plan.shapes])
        else:
            out.append([(rng.standard_normal(s) * 10.0 ** rng.integers(-6, 3)).astype(np.float16)
                        for s in plan.shapes])
    return out


def _reference(plan, grads, alpha, dtype):
    """out[r] = alpha * sum_u grads[u], this rank's rows of every parameter, in ``dtype``
    (float32: rank order, as TIDE's association for integer data; float64: the exact sum)."""
    lay, N = plan.layout, len(grads)
    outs = []
    for r in range(N):
        out = np.zeros(lay.E, dtype=dtype)
        for p in range(lay.P):
            pl = lay.params[p]
            acc = np.zeros(np.asarray(grads[0][p]).size, dtype=dtype)
            for u in range(N):
                acc = acc + np.asarray(grads[u][p], dtype=dtype).reshape(-1)
            full = np.zeros(N * pl.e, dtype=dtype)
            full[:acc.size] = acc
            out[pl.o32:pl.o32 + pl.e] = alpha * full[r * pl.e:(r + 1) * pl.e]
        outs.append(out)
    return outs


@pytest.mark.parametrize("M,L,kw", [(1, 1, {}), (1, 4, {}), (2, 2, {}), (3, 2, {"mode": "slot_reuse", "k": 1}),
                                    (2, 4, {"n_part": 2, "chunk_bytes": 64})])
def test_fp16_gradients_reduce_in_fp32(M, L, kw):
    """fp16 gradients: integer data sum exactly (bitwise the fp32 sum), normal data within fp32
    rounding of the fp64 sum; both banks; the checker accepts the programs."""
    topo = tide.Topology(M, L)
    mode = kw.pop("mode", "in_place")
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, grad_dtype="float16"), topo, mode, **kw)
    assert plan.grad_dtype == "float16"
    vc = tide.VirtualCluster(topo)
    rng = np.random.default_rng(M * 10 + L)
    ints = _fp16_grads(plan, topo.world, rng, "int")
    for _ in range(2):  # banks alternate
        outs = vc.reduce_scatter(plan, ints, scale=0.5)
        for out, ref in zip(outs, _reference(plan, ints, 0.5, np.float32)):
            assert out.dtype == np.float32 and np.array_equal(out, ref)
    normal = _fp16_grads(plan, topo.world, rng, "normal")
    outs = vc.reduce_scatter(plan, normal)
    for out, ref in zip(outs, _reference(plan, normal, 1.0, np.float64)):
        tol = 1e-6 * max(1e-30, float(np.max(np.abs(ref))))
        assert np.max(np.abs(out.astype(np.float64) - ref)) <= tol


def test_fp16_widening_is_exact_for_every_value():
    """One rank, one parameter of every fp16 bit pattern: TIDE-RS writes each widened to fp32
    exactly (subnormals included), infinities as infinities, NaNs as NaNs."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    g = bits.view(np.float16)
    plan = tide.plan(tide.GroupSignature(shapes=[(g.size,)], grad_dtype="float16"), tide.Topology(1, 1))
    out = tide.VirtualCluster(tide.Topology(1, 1)).reduce_scatter(plan, [[g]])[0]
    want = g.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))


# ---- the same on the CUDA virtual cluster (every rank on one GPU), bit for bit the CPU's --------

def _bits(x):
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).view(np.uint8).tobytes()
    return x.contiguous().view(torch.uint8).cpu().numpy().tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("M,L", CONFIGS)
def test_cuda_fp16_cast_and_reduce_bitwise_equal_cpu(M, L):
    topo = tide.Topology(M, L)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    gpu = tide.VirtualCluster(topo, backend="cuda")
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, ag_dtype="float16", shard_dtype="float32"), topo)
    shards = _cast_shards(plan, topo.world, 3)
    want = cpu.all_gather(plan, shards)
    got = gpu.all_gather(plan, [[torch.from_numpy(x).cuda() for x in row] for row in shards], poison=True)
    for r in range(topo.world):
        for p in range(plan.layout.P):
            assert _bits(got[r][p]) == _bits(want[r][p]), ("cast", r, p)
    rng = np.random.default_rng(M * 10 + L)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, grad_dtype="float16"), topo)
    prev_cpu = prev_gpu = None
    for call, scale in enumerate((1.0, 0.25, 1.0 / 3.0)):
        grads = _fp16_grads(plan, topo.world, rng, "normal" if call else "int")
        acc = call == 2
        want = cpu.reduce_scatter(plan, grads, scale=scale, accumulate=prev_cpu if acc else None)
        got = gpu.reduce_scatter(plan, [[torch.from_numpy(x).cuda() for x in row] for row in grads],
                                 scale=scale, accumulate=prev_gpu if acc else None, poison=not acc)
        for r in range(topo.world):
            assert _bits(got[r]) == _bits(want[r]), ("reduce", call, r)
        prev_cpu, prev_gpu = want, got


@pytest.mark.gpu
def test_cuda_fp16_widening_and_cast_kernels_match_torch():
    """Every fp16 bit pattern through the CUDA executor's TIDE-RS (N = 1) widens as torch does
    (NaN: any NaN), and the CAST kernel rounds fp32 as torch's CUDA ``.to(torch.float16)``."""
    from tide import _core
    bits = np.arange(1 << 16, dtype=np.uint16)
    g = torch.from_numpy(bits.view(np.int16)).view(torch.float16).cuda()
    plan = tide.plan(tide.GroupSignature(shapes=[(g.numel(),)], grad_dtype="float16"), tide.Topology(1, 1))
    out = tide.VirtualCluster(tide.Topology(1, 1), backend="cuda").reduce_scatter(plan, [[g]])[0]
    want = g.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))
    x = torch.from_numpy(_cast_cases(1 << 20, 9)).cuda()
    y = torch.empty(x.numel(), dtype=torch.float16, device="cuda")
    _core.cuda.cast(y.data_ptr(), x.data_ptr(), x.numel(), to="float16")
    torch.cuda.synchronize()
    ref = x.to(torch.float16)
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
