"""Scale: generated (lean) TIDE-RS programs against the built ones (CI), and TIDE-AG / TIDE-RS
at 1024 x 8 ranks on the CPU virtual cluster (opt-in, TIDE_SLOW=1; tests/scale_case.py)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import tide
from tide import _core

HERE = os.path.dirname(os.path.abspath(__file__))


def _plan(M, L, mode="in_place", grad_dtype="float32", **kw):
    N = M * L
    shapes = [(2 * N + 1, 4), (3,), (37, 5)]
    sig = tide.GroupSignature(shapes=shapes, grad_dtype=grad_dtype)
    return shapes, tide.plan(sig, tide.Topology(M, L), mode, **kw)


@pytest.mark.parametrize("kw", [{}, {"n_part": 2, "chunk_bytes": 64}, {"w_wave": 3}])
def test_generated_rs_programs_are_the_built_ones_op_for_op(kw):
    M, L = 16, 8
    _, plan = _plan(M, L, **kw)
    for bank in (0, 1):
        for opts in ({"alpha": 0.25}, {"accumulate": True}):
            built = _core.build_rs_programs(plan, bank=bank, **opts)
            gen = _core.generate_rs_programs(plan, bank=bank, **opts)
            assert gen.generated and not built.generated
            for r in range(M * L):
                assert built.first_difference(gen, r) == -1, (bank, opts, r)
            assert _core.rs_program_stats(gen, 5) == _core.rs_program_stats(built, 5)
    # The comparison sees a one-field difference (the bank changes outbox/spare offsets).
    assert _core.build_rs_programs(plan, bank=0).first_difference(_core.generate_rs_programs(plan, bank=1), 0) >= 0


@pytest.mark.parametrize("mode", ["in_place", "slot_reuse"])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_lean_reduce_scatter_is_bitwise_the_checked_path(mode, grad_dtype):
    """M=16, L=8: random (non-integer) gradients, so any change of operand order shows in the bits;
    four calls alternate the banks, with a scale and with accumulation."""
    M, L = 16, 8
    N = M * L
    shapes, plan = _plan(M, L, mode, grad_dtype)
    dt = np.float32 if grad_dtype == "float32" else tide.cluster._DTYPES["bfloat16"]
    rng = np.random.default_rng(3)
    topo = tide.Topology(M, L)
    checked = tide.VirtualCluster(topo, check=False, timeout_s=60)
    lean = tide.VirtualCluster(topo, lean=True, timeout_s=60)
    prev = None
    for call, scale in enumerate([1.0, 0.125, 1.0, 0.5]):
        grads = [[rng.standard_normal(size=s).astype(np.float32).astype(dt) for s in shapes] for _ in range(N)]
        acc = prev if call == 3 else None
        a = checked.reduce_scatter(plan, grads, scale=scale, accumulate=acc)
        b = lean.reduce_scatter(plan, grads, scale=scale, accumulate=acc)
        for r in range(N):
            assert np.array_equal(a[r].view(np.uint32), b[r].view(np.uint32)), (call, r)
        ref = sum(g[0].astype(np.float64) for g in grads).reshape(-1) * scale
        e, o = plan.layout.params[0].e, plan.layout.params[0].o32
        got = np.concatenate([b[r][o:o + e] for r in range(N)])[: ref.size]
        base = np.concatenate([prev[r][o:o + e] for r in range(N)])[: ref.size] if acc is not None else 0
        np.testing.assert_allclose(got, ref + base, rtol=1e-4, atol=1e-3)
        prev = b
    assert lean.rs_arena(plan).bytes_per_rank == plan.memory()["arena_bytes"]
    # The lean session generates the banks that ran (nothing built).
    session = lean.session(plan, "reduce_scatter")[0]
    assert session.calls("reduce_scatter") == 4
    runs = [(1, 1.0, False), (2, 0.125, False), (3, 1.0, False), (4, 0.5, True)]
    assert all(session.programs("reduce_scatter", *run).generated for run in runs)


@pytest.mark.parametrize("M,L", [(3, 4), (5, 2), (4, 8)])
def test_generated_producer_map_matches_the_built_ops(M, L):
    """Generated programs name a counter's producer without op tables (timeouts, wait chains)."""
    _, plan = _plan(M, L)
    built, gen = _core.build_rs_programs(plan), _core.generate_rs_programs(plan)
    n = built.num_counters
    for r in range(M * L):
        for i in range(n):
            want = built.producer(r, i)
            if want != (-1, -1):  # unused slots (e.g. the last arrival index) have no producer
                assert gen.producer(r, i) == want, (r, i)
    assert gen.producer(M * L, 0) == (-1, -1) and gen.producer(0, n) == (-1, -1)


def test_lean_timeout_names_rank_op_and_stream():
    _, plan = _plan(2, 2)
    vc = tide.VirtualCluster(tide.Topology(2, 2), lean=True, timeout_s=0.5)
    vc.faults = dict(dead_rank=1, dead_op=0)
    grads = [[np.zeros(s, np.float32) for s in [(9, 4), (3,), (37, 5)]] for _ in range(4)]
    with pytest.raises(tide.TimeoutError, match=r"rank \d .*call seq 1.*op \d+ \w+ \[stream (read|rail|land)\].*"
                                                r"producer: rank \d \[(read|rail|land|push)\] \(generated program\)"
                                                r".*(root: rank 1 is not blocked|wait chain: rank \d)"):
        vc.reduce_scatter(plan, grads)


def test_generated_sets_refuse_what_needs_built_ops():
    _, plan = _plan(2, 2)
    gen = _core.generate_rs_programs(plan)
    with pytest.raises(tide.PlanError, match="generated"):
        gen.check(2)
    with pytest.raises(tide.PlanError, match="generated"):
        _core.check_calls([[(gen, 1)]] * 4)
    with pytest.raises(tide.PlanError, match="generated"):
        gen.inject_fault(0, 0)
    arena = _core.CpuArena(4, gen, True)
    with pytest.raises(tide.PlanError, match="rank 0 runs a generated program"):
        arena.run([[(gen, 1)]] * 4, [[]] * 4, processes=True)
    with pytest.raises(tide.PlanError, match="ranks_as='threads'"):
        tide.VirtualCluster(tide.Topology(2, 2), ranks_as="processes", lean=True)
    with pytest.raises(tide.PlanError, match="RsCallOptions.bank"):
        _core.generate_rs_programs(tide.plan(tide.GroupSignature(shapes=[(8,)]), tide.Topology(2, 2)), bank=2)


def _scale_case(which):
    r = subprocess.run([sys.executable, os.path.join(HERE, "scale_case.py"), which, "1024", "8"],
                       capture_output=True, text=True, timeout=3000)
    print(r.stdout, r.stderr[-4000:], sep="\n")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    last = r.stdout.strip().splitlines()[-1]
    assert re.match(rf"SCALE {which.upper()} 1024x8 .* PASS$", last), last


@pytest.mark.slow
def test_all_gather_1024_nodes_by_8():
    _scale_case("ag")


@pytest.mark.slow
def test_reduce_scatter_1024_nodes_by_8():
    _scale_case("rs")
