"""1-byte all-gather items (FSDP2's FP8 all-gather gathers float8 data, as uint8 where a backend
has no float8).

The planner, TIDE-AG programs, the static checker and the CPU executor accept DType uint8 (also
named float8_e4m3fn / float8_e5m2) as the AG and shard dtype of a plan without a cast; a 1-byte
gradient dtype and a cast to or from 1-byte items are refused naming the field
(csrc/plan/layout.cc [Note: byte items])."""
from math import prod
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import ag_helpers
import tide
from tide import _core
from tide_apps import cli

U8 = np.dtype(np.uint8)
SHAPES = [(37, 16), (3, 5), (16,), (5, 3)]  # odd element counts: odd o_p and landings
TOPOS = [(1, 4), (2, 2), (2, 4)]
MODES = ["in_place", "slot_reuse"]
KIND = dict(_core.buf_kinds)


def _plan(M, L, shapes=SHAPES, ag="uint8", mode="in_place", **sig):
    topo = tide.Topology(nodes=M, gpus_per_node=L)
    return topo, tide.plan(tide.GroupSignature(shapes=shapes, ag_dtype=ag, **sig), topo, mode=mode)


def _fulls(shapes, N, seed):
    """Full parameters of uint8 whose bytes differ per parameter, per owning rank and per
    element (plus a per-call random offset, so a stale landing from a previous call shows)."""
    rng = np.random.default_rng(seed)
    out = []
    for p, s in enumerate(shapes):
        R = -(-s[0] // N)
        K = prod(s[1:])
        i = np.arange(s[0] * K).reshape(s[0], K)
        owner = (i // K) // R
        v = (i % (R * K)) * 7 + owner * 41 + p * 97 + int(rng.integers(0, 256))
        out.append((v % 251 + 1).astype(U8).reshape(s))  # never 0 (the padding) nor 0xFF (the poison)
    return out


def _shards(fulls, lay, N, padded):
    """ag_helpers.shard over a layout: shards[r][p], rows [r*R_p, (r+1)*R_p) (zero padded)."""
    return ag_helpers.shard(fulls, SimpleNamespace(layout=lay), N, padded)


def _landing_bytes(fulls, lay, N):
    """The parameter-major unsharded buffer every rank's ring slot must hold: each parameter's N
    R_p rows (padding rows zero) at o_p N."""
    buf = np.zeros(lay.S * N, dtype=U8)
    for p, f in enumerate(fulls):
        pl = lay.params[p]
        flat = f.reshape(-1)
        buf[pl.o * N: pl.o * N + flat.size] = flat
    return buf


@pytest.mark.parametrize("M,L", TOPOS)
def test_layout_of_byte_items(M, L):
    N = M * L
    _, plan = _plan(M, L)
    _, bf16 = _plan(M, L, ag="bfloat16")
    g, h = plan.layout, bf16.layout
    assert plan.ag_dtype == plan.shard_dtype == "uint8" and plan.grad_dtype == "bfloat16"
    o = 0
    for p, sh in enumerate(SHAPES):
        pl = g.params[p]
        R, K = -(-sh[0] // N), prod(sh[1:])
        assert (pl.R, pl.K, pl.e, pl.s, pl.o) == (R, K, R * K, R * K, o)  # s_p = R_p K_p * 1 byte
        # Item size changes bytes only: rows, elements and the RS element offsets are the bf16 plan's.
        assert (pl.R, pl.e, pl.o32) == (h.params[p].R, h.params[p].e, h.params[p].o32)
        assert h.params[p].s == 2 * pl.s and h.params[p].o == 2 * pl.o
        for r in range(N):
            assert g.landing(p, r) == pl.o * N + r * pl.s
            assert g.valid_rows(p, r) == max(0, min(R, sh[0] - r * R))
        o += pl.s
    assert g.S == o and g.NS == N * o and 2 * g.S == h.S
    assert (g.E, g.S_fp32, g.S_grad, g.B_pack) == (h.E, h.S_fp32, h.S_grad, h.B_pack)
    assert any(pl.o % 2 for pl in g.params) or any(g.landing(p, r) % 2 for p in range(len(SHAPES)) for r in range(N))
    intervals = sorted((g.landing(p, r), g.params[p].s) for p in range(len(SHAPES)) for r in range(N))
    pos = 0
    for start, size in intervals:  # abutting, no gap, no overlap
        assert start == pos
        pos += size
    assert pos == g.NS
    lay = tide.layout(SHAPES, N, ag_dtype="uint8")  # the faces' layout is the planner's
    assert [(q.R, q.s, q.o, q.o32) for q in lay.params] == [(q.R, q.s, q.o, q.o32) for q in g.params]
    # Stage, ring and resident regions in bytes of the 1-byte item.
    assert plan.ag["stage_bytes"] == (M - 1) * g.S
    mem = plan.memory()
    regions = {r["name"]: r["bytes"] for r in mem["arena"]}
    assert mem["live_tide_ns"] <= mem["live_tide_bound_ns"] + 1e-9
    assert regions["ring0"] == g.NS and regions["resident"] == g.S


def test_float8_names_are_the_byte_item():
    _, u8 = _plan(2, 2)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        _, f8 = _plan(2, 2, ag=name)
        assert f8.ag_dtype == f8.shard_dtype == "uint8" and f8.hash == u8.hash


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M,L", TOPOS)
def test_programs_pass_the_checker(M, L, mode):
    _, plan = _plan(M, L, mode=mode)
    for kw in (dict(), dict(resident=False), dict(ring_slot=1, multicast=True), dict(head_bytes=16)):
        ok, errors = _core.build_ag_programs(plan, **kw).check(2)
        assert ok, (kw, errors)
    if M == 1:
        ok, errors = _core.build_ag_programs(plan, resident=True, pull_landing=True).check(2)
        assert ok, errors
    # Descriptors coalesce as for any item: the schedule counts depend on M and P only.
    _, bf16 = _plan(M, L, ag="bfloat16", mode=mode)
    for key in ("descriptors_per_rank", "flat_descriptors_per_rank"):
        assert plan.ag[key] == bf16.ag[key]


def test_expert_lane_programs_pass_the_checker():
    _, plan = _plan(3, 1)
    ok, errors = _core.build_ag_programs(plan, expert_lane=True).check(2)
    assert ok, errors


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M,L", TOPOS)
def test_allgather_lands_every_byte(M, L, mode):
    """Every rank's shard lands bit-exactly at its parameter-major address on every rank: the
    whole ring slot (poisoned 0xFF before each call) is compared, padding rows included, and the
    other ring slot (filled with 0x5A) is never written."""
    N = M * L
    topo, plan = _plan(M, L, mode=mode)
    lay = plan.layout
    vc = tide.VirtualCluster(topo, timeout_s=10)
    for resident in (True, False):  # adopted resident shards; the user's shard buffers
        for call, padded in enumerate((True, False)):
            fulls = _fulls(SHAPES, N, seed=call + 10 * M + L + 100 * resident)
            out = vc.all_gather(plan, _shards(fulls, lay, N, padded), resident=resident, poison=True)
            arena = vc.arena(plan)  # this placement's session
            want = _landing_bytes(fulls, lay, N)
            for r in range(N):
                for p in range(len(SHAPES)):
                    assert out[r][p].dtype == U8 and np.array_equal(out[r][p], fulls[p]), (r, p, call)
                raw = np.empty(lay.S * N, dtype=U8)
                arena.read(r, KIND["ring0"], 0, raw)
                assert np.array_equal(raw, want), (r, call, np.flatnonzero(raw != want)[:8])
                if call:
                    other = np.empty(lay.S * N, dtype=U8)
                    arena.read(r, KIND["ring1"], 0, other)
                    assert (other == 0x5A).all(), (r, resident)
            if call == 0:
                for r in range(N):
                    arena.fill(r, KIND["ring1"], 0x5A)


def test_float8_arrays_are_gathered_bitwise():
    """FP8 data (ml_dtypes float8 arrays) goes in as its bytes and lands bit-exactly."""
    topo, plan = _plan(2, 2, ag="float8_e4m3fn")
    lay = plan.layout
    rng = np.random.default_rng(3)
    fulls = [rng.standard_normal(s).astype(ml_dtypes.float8_e4m3fn) for s in SHAPES]
    out = tide.VirtualCluster(topo).all_gather(plan, _shards(fulls, lay, 4, True), poison=True)
    for r in range(4):
        for p in range(len(SHAPES)):
            assert np.array_equal(out[r][p], fulls[p].view(U8))


def test_reduce_scatter_of_a_byte_item_plan_is_bf16():
    """The plan's gradients stay bf16: TIDE-RS of a uint8-AG plan runs as for any plan."""
    topo, plan = _plan(2, 2)
    N = 4
    rng = np.random.default_rng(5)
    grads = [[rng.integers(-8, 8, size=s).astype(np.float32).astype(ml_dtypes.bfloat16) for s in SHAPES]
             for _ in range(N)]
    outs = tide.VirtualCluster(topo).reduce_scatter(plan, grads, poison=True)
    lay = plan.layout
    for r in range(N):
        for p, s in enumerate(SHAPES):
            pl = lay.params[p]
            full = sum(g[p].astype(np.float32) for g in grads).reshape(s[0], -1)
            rows = full[r * pl.R:(r + 1) * pl.R].reshape(-1)
            got = np.asarray(outs[r])[pl.o32: pl.o32 + rows.size]
            assert np.array_equal(got, rows), (r, p)


@pytest.mark.parametrize("sig,match", [
    (dict(grad_dtype="uint8"), r"GroupSignature\.grad_dtype: uint8 \(1-byte items\) is an all-gather item only"),
    (dict(grad_dtype="float8_e5m2"), r"GroupSignature\.grad_dtype"),
    (dict(shard_dtype="float32"), r"GroupSignature\.ag_dtype: uint8 .* shard_dtype is float32"),
    (dict(ag="bfloat16", shard_dtype="uint8"), r"GroupSignature\.shard_dtype: uint8 .* ag_dtype is bfloat16"),
    (dict(ag="float32", shard_dtype="float8_e4m3fn"), r"GroupSignature\.shard_dtype"),
])
def test_refused_naming_the_field(sig, match):
    sig = dict(sig)
    ag = sig.pop("ag", "uint8")
    with pytest.raises(_core.PlanError, match=match):
        _plan(2, 2, ag=ag, **sig)


def test_layout_and_unknown_names_refused():
    with pytest.raises(_core.PlanError, match=r"grad_dtype: uint8"):
        tide.layout(SHAPES, 4, ag_dtype="uint8", grad_dtype="uint8")
    with pytest.raises(_core.PlanError, match=r"GroupSignature\.ag_dtype: unknown dtype 'int8'.*uint8"):
        _plan(2, 2, ag="int8")


def test_cli_plan_with_byte_items(capsys, tmp_path):
    """`tide plan --dtype uint8`: gradients default to bfloat16; the dtypes are reported."""
    import json
    f = tmp_path / "g.json"
    f.write_text(json.dumps([list(s) for s in SHAPES]))
    assert cli.main(["plan", "--shapes", str(f), "--nodes", "2", "--gpus-per-node", "4", "--json",
                     "--dtype", "float8_e4m3fn"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["dtypes"] == {"ag": "uint8", "grad": "bfloat16", "shard": "uint8"}
    assert d["layout"]["params"][0]["s"] == 5 * 16  # R_p = ceil(37/8) = 5 rows of 16 bytes


def test_regather_plan_of_byte_items():
    """A post-forward re-gather of a uint8 group plans (its unused gradients are bf16)."""
    from tide.plan import regather_plan
    _, base = _plan(2, 2)
    sub = regather_plan(base, tide.Topology(nodes=1, gpus_per_node=2))
    assert sub is not None and sub.ag_dtype == sub.shard_dtype == "uint8" and sub.grad_dtype == "bfloat16"
    for i in range(len(SHAPES)):
        assert sub.layout.landing(i, 1) == base.layout.landing(i, 2)


def test_sum_of_byte_items_is_refused():
    """1-byte items have no arithmetic: a SUM term of uint8 is a rule error of the checker and a
    failure of the CPU executor (the CUDA executor accepts bf16 and fp32 terms only)."""
    from ag_helpers import make_plan
    from test_program_ops import h, n, reduce_spec
    plan = make_plan(1, 2, shapes=[(64, 8)])[1]
    spec = reduce_spec()
    for r in range(2):
        s = spec[r]["ops"][4]
        assert s["kind"] == "SUM"
        ref, _, dst, elems, term = s["terms"][0]
        s["terms"][0] = (ref, "uint8", dst, elems, term)
    progs = _core.program_set_from_spec(plan, spec)
    ok, errors = progs.check(1)
    assert not ok and any("rule:" in e and "SUM/LAND term of uint8" in e for e in errors), errors
    g = [np.zeros(n, ml_dtypes.bfloat16) for _ in range(2)]
    outs = [np.zeros(h, np.float32) for _ in range(2)]
    with pytest.raises(Exception, match="1-byte items"):
        _core.CpuArena(2, progs).run(
            [[(progs, 1)] for _ in range(2)],
            [[(_core.buf_kinds["grad"], 0, g[r].view(np.uint8)), (_core.buf_kinds["out"], -1, outs[r].view(np.uint8))]
             for r in range(2)], timeout_s=5)


@pytest.mark.parametrize("M,L", [(2, 4), (5, 2)])
def test_head_tail_split_of_byte_items(M, L):
    """Rounds split at 16-byte heads (Options.ag_head_bytes) cut the byte stream inside
    parameters at odd offsets; every byte still lands."""
    N = M * L
    topo = tide.Topology(nodes=M, gpus_per_node=L)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, ag_dtype="uint8"), topo, ag_head_bytes=16)
    fulls = _fulls(SHAPES, N, seed=7)
    vc = tide.VirtualCluster(topo, timeout_s=10)
    for resident in (True, False):
        out = vc.all_gather(plan, _shards(fulls, plan.layout, N, True), resident=resident, poison=True)
        for r in range(N):
            for p in range(len(SHAPES)):
                assert np.array_equal(out[r][p], fulls[p]), (r, p, resident)


@pytest.mark.gpu
@pytest.mark.parametrize("M,L", [(1, 4), (2, 2)])
def test_cuda_allgather_of_byte_items_equals_the_cpu(M, L):
    """The CUDA executor (ranks of one GPU: the SM copy kernel's 1-byte unit) lands 1-byte items
    bitwise where the CPU cluster does, resident and user shards."""
    torch = pytest.importorskip("torch")
    N = M * L
    topo, plan = _plan(M, L)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    gpu = tide.VirtualCluster(topo, backend="cuda")
    for resident in (True, False):
        shards = _shards(_fulls(SHAPES, N, seed=7 + resident), plan.layout, N, True)
        want = cpu.all_gather(plan, shards, resident=resident)
        got = gpu.all_gather(plan, [[torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in row]
                                    for row in shards], resident=resident, poison=True)
        for r in range(N):
            for p in range(len(SHAPES)):
                assert np.array_equal(got[r][p].cpu().numpy(), want[r][p]), (resident, r, p)
