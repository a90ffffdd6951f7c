"""CUDA executor over the shared program IR: same bytes as the CPU executor.

Every case runs one plan on the CPU virtual cluster and on the CUDA one (all ranks on one GPU)
and compares the outputs bit for bit, then checks the applicable fault kinds fail-stop with a
message naming rank, op and seq. Run on the GPU machine (python3 tools/gpu/run.py executor).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
import tide  # noqa: E402
from tide import _core  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
GRID = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (3, 2), (4, 2), (5, 1), (2, 8)]
SHAPES = [(37, 16), (5,), (64, 3, 8), (9, 40), (3, 7), (128, 24)]


def _shards(plan, world, rng, dtype=BF16):
    lay = plan.layout
    shapes = _core.plan_shapes(plan)
    out = []
    for r in range(world):
        row = []
        for p in range(lay.P):
            pl = lay.params[p]
            rows = max(0, min(pl.R, pl.D - r * pl.R))
            k = int(np.prod(shapes[p][1:])) if len(shapes[p]) > 1 else 1
            row.append(rng.standard_normal(rows * k).astype(np.float32).astype(dtype))
        out.append(row)
    return out


def _to_torch(a):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()


def _bits(x):
    if isinstance(x, np.ndarray):
        return x.view(np.uint8).tobytes()
    return x.contiguous().view(torch.uint8).cpu().numpy().tobytes()


@pytest.mark.parametrize("M,L", GRID)
@pytest.mark.parametrize("resident", [True, False])
def test_all_gather_bitwise_equals_cpu(M, L, resident, options=None):
    topo = tide.Topology(M, L)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    rng = np.random.default_rng(M * 100 + L)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    gpu = tide.VirtualCluster(topo, backend="cuda", options=options)
    assert gpu.backend == "cuda"
    for call in range(3):  # epochs advance across calls; counters are never reset
        shards = _shards(plan, topo.world, rng)
        want = cpu.all_gather(plan, shards, resident=resident)
        got = gpu.all_gather(plan, [[_to_torch(x) for x in row] for row in shards], resident=resident,
                             poison=(call == 0))
        for r in range(topo.world):
            for p in range(len(SHAPES)):
                assert tuple(got[r][p].shape) == tuple(want[r][p].shape)
                assert _bits(got[r][p]) == _bits(np.ascontiguousarray(want[r][p])), (call, r, p)
                full = np.concatenate([s[p] for s in shards]).reshape(want[r][p].shape)
                assert _bits(np.ascontiguousarray(want[r][p])) == _bits(full)


@pytest.mark.parametrize("M,L", [(2, 2), (3, 2)])
def test_all_gather_ring_slots_and_mixed_precision(M, L):
    topo = tide.Topology(M, L)
    rng = np.random.default_rng(5)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, shard_dtype="float32"), topo)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    gpu = tide.VirtualCluster(topo, backend="cuda")
    for slot in (0, 1, 0):
        shards = _shards(plan, topo.world, rng, np.dtype(np.float32))
        want = cpu.all_gather(plan, shards, ring_slot=slot)
        got = gpu.all_gather(plan, [[_to_torch(x) for x in row] for row in shards], ring_slot=slot, poison=True)
        for r in range(topo.world):
            for p in range(len(SHAPES)):
                assert _bits(got[r][p]) == _bits(np.ascontiguousarray(want[r][p])), (slot, r, p)


def _direct(plan, progs, world):
    return _core.cuda.InProcessFabric([0] * world, progs.arena_bytes())


def _executor(fabric, timeout_s):
    return _core.cuda.ClusterExecutor(fabric, options={"timeout_s": timeout_s})


def _bindings(plan, world, rng):
    lay = plan.layout
    keep, b = [], []
    for r in range(world):
        row = []
        for p in range(lay.P):
            t = torch.randn(lay.params[p].e, device="cuda").to(torch.bfloat16)
            keep.append(t)
            row.append((_core.buf_kinds["shard"], p, t.data_ptr(), 2 * t.numel()))
        b.append(row)
    return keep, b


def test_fault_dropped_credit_is_a_timeout_naming_the_wait():
    topo = tide.Topology(3, 2)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    progs = _core.build_ag_programs(plan, resident=False, with_expects=False).copy()
    assert progs.inject_fault(_core.fault_kinds["drop_credit"], 1)
    fab = _direct(plan, progs, topo.world)
    ex = _executor(fab, 2.0)
    keep, b = _bindings(plan, topo.world, None)
    with pytest.raises(TimeoutError, match=r"rank \d+ op \d+ \(.*WAIT.*\) seq \d"):
        for seq in (1, 2, 3):
            ex.run(progs, seq, b)
            ex.synchronize()
    del keep


def test_fault_dead_peer_is_a_timeout():
    topo = tide.Topology(2, 2)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    progs = _core.build_ag_programs(plan, resident=False, with_expects=False)
    ex = _executor(_direct(plan, progs, topo.world), 2.0)
    ex.set_faults(dead_rank=1)
    keep, b = _bindings(plan, topo.world, None)
    with pytest.raises(TimeoutError, match=r"seq 1"):
        ex.run(progs, 1, b)
        ex.synchronize()
    with pytest.raises(RuntimeError, match="fail-stop"):
        ex.run(progs, 2, b)  # fail-stop: the executor refuses further calls
    del keep


def test_fault_stalled_peer_watchdog():
    topo = tide.Topology(2, 2)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    progs = _core.build_ag_programs(plan, resident=False, with_expects=False)
    fab = _direct(plan, progs, topo.world)
    keep, b = _bindings(plan, topo.world, None)
    ok = _executor(fab, 5.0)
    ok.set_faults(stall_rank=1, stall_s=0.2)  # shorter than the deadline: just late
    ok.run(progs, 1, b)
    ok.synchronize()
    ex = _executor(fab, 0.3)
    ex.set_faults(stall_rank=1, stall_s=2.0)  # past the deadline: the watchdog fires
    with pytest.raises(TimeoutError, match=r"rank \d+ op \d+ .* seq 2"):
        ex.run(progs, 2, b)
        ex.synchronize()
    del keep


def test_fault_other_plan_is_refused():
    topo = tide.Topology(2, 2)
    a = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    bplan = tide.plan(tide.GroupSignature(shapes=SHAPES[:-1]), topo)
    pa = _core.build_ag_programs(a, resident=False, with_expects=False)
    pb = _core.build_ag_programs(bplan, resident=False, with_expects=False)
    mixed = _core.testing.mixed_programs(pa, pb, 1)
    fab = _core.cuda.InProcessFabric([0] * topo.world, max(pa.arena_bytes(), pb.arena_bytes()))
    keep, b = _bindings(a, topo.world, None)
    with pytest.raises(ValueError, match="inconsistent programs"):
        _executor(fab, 2.0).run(mixed, 1, b)  # refused before anything is enqueued


def test_multicast_gate_never_opens_here():
    assert not _core.cuda.multicast_allowed(0)


RS_GRID = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (3, 2), (4, 2), (2, 8), (9, 2)]


def _grads(plan, world, rng):
    shapes = _core.plan_shapes(plan)
    return [[rng.standard_normal(int(np.prod(s))).astype(np.float32).astype(BF16).reshape(s) for s in shapes]
            for _ in range(world)]


@pytest.mark.parametrize("M,L", RS_GRID)
def test_reduce_scatter_bitwise_equals_cpu(M, L, options=None):
    topo = tide.Topology(M, L)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    rng = np.random.default_rng(7 * M + L)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    gpu = tide.VirtualCluster(topo, backend="cuda", options=options)
    prev_cpu = prev_gpu = None
    for call, scale in enumerate((1.0, 0.25, 1.0 / 3.0, 0.5)):  # banks alternate: seq mod 2
        grads = _grads(plan, topo.world, rng)
        acc = call >= 2
        want = cpu.reduce_scatter(plan, grads, scale=scale, accumulate=prev_cpu if acc else None)
        got = gpu.reduce_scatter(plan, [[_to_torch(x) for x in row] for row in grads], scale=scale,
                                 accumulate=prev_gpu if acc else None, poison=not acc)
        for r in range(topo.world):
            assert not torch.isnan(got[r]).any(), f"call {call} rank {r}: unwritten output elements"
            assert _bits(got[r]) == _bits(np.ascontiguousarray(want[r])), (call, r)
        prev_cpu, prev_gpu = want, got
    # fp64 reference of the last non-accumulating semantics is covered by the CPU tests; here a
    # sanity check of the magnitude: out = prev + scale * sum_u grads
    assert all(torch.isfinite(x).all() for x in got)


@pytest.mark.parametrize("M,L", [(1, 8), (2, 4), (3, 2)])
def test_copy_lanes_bitwise_equals_cpu(M, L):
    """[Note: copy lanes] with EVERY COPY/PUT spread over 3 lanes (threshold 0): the same bytes as
    the CPU executor, call after call; a PUT's bump issued before its lanes joined would show as
    stale landing or inbox bytes. Every copy on the copy engines: the lanes are theirs (copies
    between ranks of one GPU would otherwise run on SMs, [Note: copies on SMs])."""
    options = tide.ExecutorOptions(copy_spread_bytes=0, copy_lanes=3, copies_on="copy_engines")
    test_all_gather_bitwise_equals_cpu(M, L, resident=True, options=options)
    test_reduce_scatter_bitwise_equals_cpu(M, L, options=options)


@pytest.mark.parametrize("copies_on", ["sms", "copy_engines"])
@pytest.mark.parametrize("M,L", [(1, 8), (2, 4)])
def test_copies_on_bitwise_equals_cpu(M, L, copies_on):
    """[Note: copies on SMs]: every COPY/PUT on TIDE's copy kernel (3 CTAs: each CTA strides over
    many units) or every one on the copy engines gives the CPU executor's bytes, call after call;
    a PUT's bump before its kernel's stores would show as stale landing or inbox bytes."""
    options = tide.ExecutorOptions(copies_on=copies_on, copy_ctas=3)
    test_all_gather_bitwise_equals_cpu(M, L, resident=True, options=options)
    test_reduce_scatter_bitwise_equals_cpu(M, L, options=options)


@pytest.mark.parametrize("M", [2, 3, 5])
def test_expert_lane_and_hsdp_bitwise_equal_cpu(M):
    topo = tide.Topology(M, 1)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    rng = np.random.default_rng(M)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    gpu = tide.VirtualCluster(topo, backend="cuda")
    for _ in range(2):
        grads = _grads(plan, topo.world, rng)
        want = cpu.reduce_scatter_expert(plan, grads, scale=0.5)
        got = gpu.reduce_scatter_expert(plan, [[_to_torch(x) for x in row] for row in grads], scale=0.5)
        for r in range(topo.world):
            assert _bits(got[r]) == _bits(np.ascontiguousarray(want[r]))
    groups = [_grads(plan, topo.world, rng) for _ in range(2)]
    want = cpu.reduce_scatter_hsdp(plan, groups)
    got = gpu.reduce_scatter_hsdp(plan, [[[_to_torch(x) for x in row] for row in g] for g in groups])
    for g in range(2):
        for r in range(topo.world):
            assert _bits(got[g][r]) == _bits(np.ascontiguousarray(want[g][r]))


# ---- CTA budgets: the plan's solver (Eqs. 13-14) reaches the launches; a session override wins --
def _launch_grids(fn):
    """(kernel name, grid x) of every SUM / REDUCE kernel that fn() launches, from the profiler's
    trace (CUPTI sees the executor's own streams too)."""
    import json
    import os
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return [(ev["name"], ev["args"]["grid"][0]) for ev in events
            if ev.get("cat") == "kernel" and ("sum_kernel" in ev["name"] or "reduce_kernel" in ev["name"])]


def _sum_land_ops(plan):
    """SUM and LAND ops of one RS call over every rank (one launch each)."""
    ps = _core.build_rs_programs(plan, bank=0, alpha=1.0, accumulate=False, expert_lane=False)
    kinds = [line.split()[1] for r in range(plan.world) for line in ps.describe(r)]
    return kinds.count("SUM"), kinds.count("LAND")


@pytest.mark.parametrize("M,L,plan_ctas,override", [
    (1, 4, {}, None),                               # the solver's C_sum / C_mc
    (2, 2, {}, None),
    (2, 2, {"sum_ctas": 5, "land_ctas": 3}, None),  # given to the planner: the solver records them
    (2, 2, {}, (7, 2)),                             # a session override, not the plan's
])
def test_sum_and_land_launch_with_the_plan_budgets(M, L, plan_ctas, override):
    topo = tide.Topology(M, L)
    # Ops large enough that no launch is clamped below its budget (a CTA per 2048 elements at most).
    plan = tide.plan(tide.GroupSignature(shapes=[(2048, 512), (1024, 256), (300, 64)]), topo, **plan_ctas)
    want_sum, want_land = override or (plan.solver["sum_ctas"], plan.solver["land_ctas"])
    if plan_ctas:
        assert (want_sum, want_land) == (plan_ctas["sum_ctas"], plan_ctas["land_ctas"])
    assert want_sum != want_land, "the test tells SUM from LAND launches by their grids"
    assert (want_sum, want_land) != (16, 4), "the executors' fallback budgets would pass unseen"
    kw = {} if override is None else {"sum_ctas": override[0], "land_ctas": override[1]}
    gpu = tide.VirtualCluster(topo, backend="cuda", **kw)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    rng = np.random.default_rng(M * 10 + L)
    grads = _grads(plan, topo.world, rng)
    dev = [[_to_torch(x) for x in row] for row in grads]
    gpu.reduce_scatter(plan, dev)  # the session's first call (program sets, run tables) unprofiled
    got = []
    grids = _launch_grids(lambda: got.append(gpu.reduce_scatter(plan, dev, poison=True)))
    n_sum, n_land = _sum_land_ops(plan)
    assert n_sum and (n_land > 0) == (M > 1)  # one node: the Level-1 SUM writes the output, no LAND
    assert sorted({g for _, g in grids}) == sorted({want_sum, want_land} if n_land else {want_sum}), grids
    assert sum(g == want_sum for _, g in grids) == n_sum, grids
    assert sum(g == want_land for _, g in grids) == n_land, grids
    assert all(g == want_sum for name, g in grids if "sum_kernel" in name), grids
    want = cpu.reduce_scatter(plan, grads)
    for r in range(topo.world):  # a budget changes the grid, never the bits
        assert _bits(got[0][r]) == _bits(np.ascontiguousarray(want[r])), r


@pytest.mark.parametrize("M,L", [(1, 8), (2, 4)])
@pytest.mark.parametrize("resident", [True, False])
def test_replayed_all_gather_bitwise_equals_eager_and_cpu(M, L, resident):
    """ExecutorOptions.graphs ([Note: replayed calls]): with the same input tensors every call
    (refilled in place), call 2 of the set is captured and calls 3.. are replayed; every landing
    is bit-equal to the CPU cluster's and to an eager CUDA cluster's."""
    topo = tide.Topology(M, L)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), topo)
    rng = np.random.default_rng(11 * M + L)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    eager = tide.VirtualCluster(topo, backend="cuda")
    gpu = tide.VirtualCluster(topo, backend="cuda", options=tide.ExecutorOptions(graphs=True))
    held = None  # the bound tensors: one set for every call
    for call in range(6):
        shards = _shards(plan, topo.world, rng)
        if held is None:
            held = [[_to_torch(x) for x in row] for row in shards]
        else:
            for row, xs in zip(held, shards):
                for t, x in zip(row, xs):
                    t.copy_(_to_torch(x))
        want = cpu.all_gather(plan, shards, resident=resident)
        ref = eager.all_gather(plan, [[_to_torch(x) for x in row] for row in shards], resident=resident)
        got = gpu.all_gather(plan, held, resident=resident, poison=True)
        for r in range(topo.world):
            for p in range(len(SHAPES)):
                want_bits = _bits(np.ascontiguousarray(want[r][p]))
                assert _bits(got[r][p]) == want_bits, (call, r, p)
                assert _bits(ref[r][p]) == want_bits, (call, r, p)
    (_, ex), = gpu._sessions.values()
    # The cluster's own per-call buffers may move in the caching allocator, so not every call
    # meets a captured key; at least one capture and one replay after it must have run.
    assert ex.graph_captures >= 1 and ex.graph_launches >= ex.graph_captures + 1, \
        (ex.graph_captures, ex.graph_launches)
    (_, ex_eager), = eager._sessions.values()
    assert (ex_eager.graph_captures, ex_eager.graph_launches) == (0, 0)
