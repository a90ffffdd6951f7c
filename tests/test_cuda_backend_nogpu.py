"""The CUDA backend's Python surface where no GPU is usable (runs in CI)."""
import pytest

import tide
from tide import _core


def test_cuda_backend_refuses_cleanly_without_gpu():
    if _core.built_with_cuda and _core.cuda_available():
        pytest.skip("a GPU is usable here: tests/test_cuda_executor.py covers the backend")
    with pytest.raises(tide.PlanError, match="needs a CUDA build of tide._core and a GPU"):
        tide.VirtualCluster(tide.Topology(1, 2), backend="cuda")


def test_cpu_backend_unchanged_by_the_hook():
    vc = tide.VirtualCluster(tide.Topology(1, 2))
    assert type(vc).__name__ == "VirtualCluster" and vc.backend == "cpu"


def test_multicast_gate_closed_without_opt_in(monkeypatch):
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build")
    monkeypatch.delenv("TIDE_ENABLE_MULTICAST", raising=False)
    assert _core.cuda_multicast_allowed(0) is False  # gate fails before touching the driver


def test_bench_layout_module_imports_without_gpu():
    from tide.bench import layout
    import tide
    from tide import models
    plan = tide.plan(models.signature(layout.GROUPS["llama70b"], "block"), tide.Topology(1, 8))
    lay = layout._layout(plan)  # the bench's geometry is the plan's
    assert 8 * 2 * lay.E == 1711308800  # NS of the 70B layer group, bytes


# ---- CudaRankExecutor / CudaIpcFabric (tide_torch's per-rank CUDA path): the binding surface ------
def _params(fn):
    """Parameter names of a nanobind function, from its signature line."""
    import re
    sig = (fn.__doc__ or "").splitlines()[0]
    return re.findall(r"(\w+):", sig[sig.index("(") + 1:])


def test_rank_executor_binding_surface():
    if not _core.built_with_cuda:
        for name in ("CudaIpcFabric", "CudaRankExecutor", "cuda_capabilities"):
            with pytest.raises(tide.PlanError, match=f"{name}: this build of tide._core has no CUDA executor"):
                getattr(_core, name)(0)
        return
    assert _params(_core.CudaIpcFabric.__init__) == ["rank", "world", "device", "arena_bytes"]
    assert _params(_core.CudaRankExecutor.__init__) == ["fabric", "rank", "nodes", "gpus_per_node", "regions",
                                                        "timeout_s", "fence", "sum_ctas", "land_ctas"]
    assert _params(_core.CudaRankExecutor.run) == ["programs", "seq", "buffers", "stream", "ranks"]
    assert "= 30.0" in _core.CudaRankExecutor.__init__.__doc__.splitlines()[0]
    for name in ("arena_ptr", "rank", "world", "device", "arena_bytes", "peers_open"):
        assert isinstance(getattr(_core.CudaIpcFabric, name), property), name
    for name in ("handle", "open_peers", "peer_arena_ptr"):
        assert callable(getattr(_core.CudaIpcFabric, name)), name
    assert callable(_core.CudaRankExecutor.synchronize) and callable(_core.cuda_capabilities)


def test_ipc_fabric_refuses_cleanly_without_gpu():
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build: test_rank_executor_binding_surface covers the refusal")
    with pytest.raises(tide.PlanError, match="rank 2 is outside"):
        _core.CudaIpcFabric(2, 2, 0, 1 << 20)
    with pytest.raises(tide.PlanError, match="arena_bytes must be positive"):
        _core.CudaIpcFabric(0, 2, 0, 0)
    if _core.cuda_available():
        pytest.skip("a GPU is usable here: tests/test_cuda_ipc.py covers the fabric")
    with pytest.raises(tide.PlanError, match="device 0 is not a usable CUDA device"):
        _core.CudaIpcFabric(0, 2, 0, 1 << 20)
    with pytest.raises(TypeError):  # no fabric, no executor
        _core.CudaRankExecutor(None, 0, 1, 2)
    with pytest.raises(_core.Error):  # the probe reports the missing device instead of crashing
        _core.cuda_capabilities(0)


def test_cuda_cluster_inherits_the_base_defaults():
    """CudaVirtualCluster has its own __init__: state the CPU base reads (e.g. `lean` in
    _checking) comes from class defaults, so a new base option cannot break the CUDA backend."""
    from tide.cluster import VirtualCluster
    from tide.cluster_cuda import CudaVirtualCluster
    vc = object.__new__(CudaVirtualCluster)
    assert isinstance(vc, VirtualCluster) and vc.lean is False


# ---- copy lanes ([Note: copy lanes] in runtime.h): the knobs are checked before any CUDA call ----
@pytest.mark.parametrize("value, ok", [("1", 1), ("3", 3), ("8", 8), ("0", None), ("9", None), ("two", None)])
def test_copy_lanes_knob(value, ok, monkeypatch):
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build")
    monkeypatch.setenv("TIDE_COPY_LANES", value)
    if ok is None:
        with pytest.raises(tide.PlanError, match="TIDE_COPY_LANES must be an integer in \\[1, 8\\]"):
            _core.cuda_copy_lanes()
    else:
        assert _core.cuda_copy_lanes() == ok
    monkeypatch.delenv("TIDE_COPY_LANES")
    assert _core.cuda_copy_lanes() == 4


@pytest.mark.parametrize("group", ["llama70b", "qwen3", "wan22"])
@pytest.mark.parametrize("cuts", [[4], [2, 4, 6], list(range(1, 8))])
def test_layout_bench_row_pieces_cover_the_staging_copies(group, cuts):
    """The layout bench's chunked RS splits every Level-1 staging copy at the cut block rows: the
    pieces move the same bytes, byte for byte at the same addresses, with no empty or negative
    copy (a copy may start at any row), and piece k holds only block rows of chunk k."""
    from tide import models
    from tide.bench import layout
    L = 8
    plan = tide.plan(models.signature(layout.GROUPS[group], "block"), tide.Topology(1, L))
    e_sub = plan.rs_schedule.E_sub
    slot_bytes = 2 * L * e_sub
    bases = [(1 << 40) + j * slot_bytes for j in range(L - 1)]
    copies = []
    for slot, u in enumerate(range(1, L)):
        for c in _core.rs_level1_copies(plan, u):
            if c["owner"] == 0 and c["s"] == 0:
                copies.append((bases[slot] + c["dst_offset"], (1 << 30) * u + c["src_offset"], c["width"],
                               c["height"], c["dst_pitch"], c["src_pitch"]))
    pieces = layout.row_pieces(copies, bases, 2 * e_sub, cuts)
    assert len(pieces) == len(cuts) + 1

    def rows(cs):
        return sorted((d + r * dp, s + r * sp, w) for d, s, w, h, dp, sp in cs for r in range(h))
    assert all(h >= 1 for p in pieces for _, _, _, h, _, _ in p)
    assert rows([c for p in pieces for c in p]) == rows(copies)
    bounds = [0] + list(cuts) + [L]
    for k, p in enumerate(pieces):
        for d, s, w, h, dp, sp in p:
            base = max(b for b in bases if b <= d)
            first, last = (d - base) // (2 * e_sub), (d - base + (h - 1) * dp) // (2 * e_sub)
            assert bounds[k] <= first and last < bounds[k + 1]
    with pytest.raises(ValueError, match="increasing"):
        layout.row_pieces(copies, bases, 2 * e_sub, [4, 4])


def test_layout_bench_rs_reference_and_bit_diff():
    """The layout bench's RS reference: per block segment, peers 1.. in slot order, then rank 0's
    own term, fp32 adds, then alpha; padding segments give +0. bit_diff names the first differing
    element and its block row."""
    torch = pytest.importorskip("torch")
    from tide.bench import layout
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(4, 6, generator=gen).to(torch.bfloat16)] for _ in range(3)]
    segs = [(0, 12, 0, 0), (12, 4, 0, -1), (16, 12, 12, 0)]  # two block rows of 16, one pad piece
    got = layout.rs_reference(torch, grads, segs, 16, 26, 0.5)
    flat = [g[0].view(-1).float() for g in grads]
    want = torch.zeros(26)
    want[0:12] = ((flat[1][0:12] + flat[2][0:12]) + flat[0][0:12]) * 0.5
    want[16:26] = ((flat[1][12:22] + flat[2][12:22]) + flat[0][12:22]) * 0.5
    assert layout.bit_diff(torch, want, got, 16) == (True, None)
    bad = got.clone()
    bad[17] = 5.0
    ok, d = layout.bit_diff(torch, want, bad, 16)
    assert not ok and d["count"] == 1 and d["first"] == 17 and d["block_row"] == 1 and d["got"] == 5.0


def _knob(monkeypatch, name, value):
    """A CUDA build's knob `name` set to `value` (None: unset) for one test."""
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build")
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("value, want", [(None, "auto"), ("auto", "auto"), ("tiles", "tiles"), ("ranges", "ranges"),
                                         ("grid", None)])
def test_cta_split_knob(value, want, monkeypatch):
    """TIDE_CTA_SPLIT picks how SUM, LAND and REDUCE split their elements (device.cuh); auto runs
    ranges below 32 CTAs and tiles from there; a bad value names the variable."""
    _knob(monkeypatch, "TIDE_CTA_SPLIT", value)
    if want is None:
        with pytest.raises(tide.PlanError, match="TIDE_CTA_SPLIT=grid: expected auto, tiles or ranges"):
            _core.cuda_cta_split()
        return
    assert _core.cuda_cta_split() == want
    for ctas, auto in ((1, "ranges"), (31, "ranges"), (32, "tiles"), (264, "tiles")):
        assert _core.cuda_cta_split(ctas) == (auto if want == "auto" else want)


# (variable, getter, value, want): want None = a bad value, named with the variable in the error.
BOOL_KNOBS = [("TIDE_COPY_2D", "cuda_copy_2d_batched", v, w, "TIDE_COPY_2D must be 'batch' or 'per_copy'")
              for v, w in [(None, True), ("batch", True), ("per_copy", False), ("2d", None)]]
BOOL_KNOBS += [("TIDE_LAND_DEEP", "cuda_land_deep", v, w, "TIDE_LAND_DEEP=yes: expected 0 or 1")
               for v, w in [(None, True), ("1", True), ("0", False), ("yes", None)]]
BOOL_KNOBS += [("TIDE_FULL_GRID", "cuda_full_grid_tiles", v, w, "TIDE_FULL_GRID=all: expected tiles or wave")
               for v, w in [(None, True), ("tiles", True), ("wave", False), ("all", None)]]


@pytest.mark.parametrize("name, getter, value, want, error", BOOL_KNOBS)
def test_boolean_knobs(name, getter, value, want, error, monkeypatch):
    """TIDE_COPY_2D picks the eager 2-D copy path (runtime.h), TIDE_LAND_DEEP the one-source
    overwrite LAND's tile depth, TIDE_FULL_GRID the grid of a whole-wave budget (kernels.h); a
    bad value names the variable."""
    _knob(monkeypatch, name, value)
    if want is None:
        with pytest.raises(tide.PlanError, match=error):
            getattr(_core, getter)()
    else:
        assert getattr(_core, getter)() is want


def test_native_stack_dump_on_signal():
    """cuda_install_stack_dump(sig): the signalled process writes its native backtrace to stderr
    and keeps running (the hang reports of tests/test_cuda_ipc.py and tools/gpu/hang.sh)."""
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build")
    import subprocess
    import sys
    code = ("import os, signal\nfrom tide import _core\n_core.cuda_install_stack_dump(signal.SIGUSR2)\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\nprint('still running')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "still running"
    assert "-- tide native stack, pid " in r.stderr, r.stderr
    frames = [ln for ln in r.stderr.splitlines() if "[0x" in ln]
    assert any("_core" in ln for ln in frames) and any("libc" in ln for ln in frames), r.stderr
