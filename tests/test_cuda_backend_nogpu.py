"""The CUDA backend's Python surface where no GPU is usable (runs in CI)."""
import pytest

import tide
from tide import _core


def test_cuda_backend_refuses_cleanly_without_gpu():
    if _core.built_with_cuda and _core.cuda.available():
        pytest.skip("a GPU is usable here: tests/test_cuda_executor.py covers the backend")
    with pytest.raises(tide.PlanError, match="needs a CUDA build of tide._core and a GPU"):
        tide.VirtualCluster(tide.Topology(1, 2), backend="cuda")


def test_cpu_backend_is_the_default():
    vc = tide.VirtualCluster(tide.Topology(1, 2))
    assert type(vc).__name__ == "VirtualCluster" and vc.backend == "cpu"
    with pytest.raises(tide.PlanError, match="VirtualCluster.backend: expected 'cpu' or 'cuda', got 'tpu'"):
        tide.VirtualCluster(tide.Topology(1, 2), backend="tpu")


def test_multicast_gate_closed_without_opt_in(monkeypatch):
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build")
    monkeypatch.delenv("TIDE_ENABLE_MULTICAST", raising=False)
    assert _core.cuda.multicast_allowed(0) is False  # gate fails before touching the driver


def test_bench_layout_module_imports_without_gpu():
    from tide_apps.bench import layout
    import tide
    from tide import models
    plan = tide.plan(models.signature(layout.GROUPS["llama70b"], "block"), tide.Topology(1, 8))
    lay = layout._layout(plan)  # the bench's geometry is the plan's
    assert 8 * 2 * lay.E == 1711308800  # NS of the 70B layer group, bytes


# ---- tide._core.cuda.RankExecutor / IpcFabric (tide_torch's per-rank CUDA path): the binding surface --
def _params(fn):
    """Parameter names of a nanobind function, from its signature line."""
    import re
    sig = (fn.__doc__ or "").splitlines()[0]
    return re.findall(r"(\w+):", sig[sig.index("(") + 1:])


def test_rank_executor_binding_surface():
    if not _core.built_with_cuda:
        for name in ("IpcFabric", "RankExecutor", "capabilities"):
            with pytest.raises(tide.PlanError, match=f"cuda.{name}: this build of tide._core has no CUDA executor"):
                getattr(_core.cuda, name)(0)
        return
    assert _params(_core.cuda.IpcFabric.__init__) == ["rank", "world", "device", "arena_bytes"]
    assert _params(_core.cuda.RankExecutor.__init__) == ["fabric", "rank", "nodes", "gpus_per_node", "regions",
                                                        "timeout_s", "fence", "options"]
    assert _params(_core.RankExecutor.__init__)[-3:] == ["timeout_s", "fence", "options"]  # the faces alike
    assert _params(_core.cuda.RankExecutor.run) == ["programs", "seq", "buffers", "stream", "ranks"]
    assert issubclass(_core.cuda.RankExecutor, _core.CallExecutor)
    assert issubclass(_core.cuda.ClusterExecutor, _core.CallExecutor)
    for name in ("arena_ptr", "rank", "world", "device", "arena_bytes", "peers_open"):
        assert isinstance(getattr(_core.cuda.IpcFabric, name), property), name
    for name in ("handle", "open_peers", "peer_arena_ptr"):
        assert callable(getattr(_core.cuda.IpcFabric, name)), name
    assert callable(_core.cuda.RankExecutor.synchronize) and callable(_core.cuda.capabilities)


def test_ipc_fabric_refuses_cleanly_without_gpu():
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build: test_rank_executor_binding_surface covers the refusal")
    with pytest.raises(tide.PlanError, match="rank 2 is outside"):
        _core.cuda.IpcFabric(2, 2, 0, 1 << 20)
    with pytest.raises(tide.PlanError, match="arena_bytes must be positive"):
        _core.cuda.IpcFabric(0, 2, 0, 0)
    if _core.cuda.available():
        pytest.skip("a GPU is usable here: tests/test_cuda_ipc.py covers the fabric")
    with pytest.raises(tide.PlanError, match="device 0 is not a usable CUDA device"):
        _core.cuda.IpcFabric(0, 2, 0, 1 << 20)
    with pytest.raises(TypeError):  # no fabric, no executor
        _core.cuda.RankExecutor(None, 0, 1, 2)
    with pytest.raises(_core.Error):  # the probe reports the missing device instead of crashing
        _core.cuda.capabilities(0)


# ---- executor options: typed fields, validated by the core; the environment only as an override -
@pytest.mark.parametrize("field, value, error", [
    ("copy_lanes", 0, "ExecutorOptions.copy_lanes: expected 1..8, got 0"),
    ("copy_lanes", 9, "ExecutorOptions.copy_lanes: expected 1..8, got 9"),
    ("cta_split", "grid", "ExecutorOptions: cta_split: expected one of auto, tiles, ranges, got 'grid'"),
    ("full_grid", "all", "ExecutorOptions: full_grid: expected one of tiles, wave, got 'all'"),
    ("copy_2d", "2d", "ExecutorOptions: copy_2d: expected one of batch, per_copy, got '2d'"),
    ("copies_on", "ce", "ExecutorOptions: copies_on: expected one of auto, copy_engines, sms, got 'ce'"),
    ("copy_ctas", 0, "ExecutorOptions.copy_ctas: expected 1..4096, got 0"),
    ("copy_ctas", 4097, "ExecutorOptions.copy_ctas: expected 1..4096, got 4097"),
    ("timeout_s", float("nan"), "ExecutorOptions.timeout_s: expected a finite number of seconds"),
    ("timeout_s", -1.0, "ExecutorOptions.timeout_s: expected a finite number of seconds"),
    ("copy_spread_bytes", -1, "ExecutorOptions.copy_spread_bytes: expected >= 0"),
    ("workers", -2, "ExecutorOptions.workers: expected 0..1024"),
    ("cast_ctas", 0, "ExecutorOptions.cast_ctas: expected 1..4096"),
    ("trace", 1, "ExecutorOptions.trace: 1 has the wrong type"),
    ("copy_lanes", True, "ExecutorOptions.copy_lanes: True has the wrong type"),
    ("copy_lanes", "3", "ExecutorOptions.copy_lanes: '3' has the wrong type"),
])
def test_executor_options_are_validated_by_field(field, value, error):
    with pytest.raises(tide.PlanError) as info:
        tide.ExecutorOptions(**{field: value})
    assert error in str(info.value), str(info.value)


def test_executor_options_round_trip_and_debug_env(monkeypatch):
    """The fields reach the core unchanged; TIDE_EXEC_OPTIONS and TIDE_DEBUG are overrides applied
    when an executor is made (ExecutorOptions.effective() shows them), a garbage override names
    the variable and the field, and an executor refuses to start with one."""
    monkeypatch.delenv("TIDE_EXEC_OPTIONS", raising=False)
    monkeypatch.delenv("TIDE_DEBUG", raising=False)
    o = tide.ExecutorOptions(cta_split="tiles", copy_lanes=2, timeout_s=5.0)
    text = o.effective()
    assert "cta_split=tiles" in text and "copy_lanes=2" in text and "timeout_s=5" in text and "trace=0" in text
    monkeypatch.setenv("TIDE_EXEC_OPTIONS", "cta_split=ranges,copy_lanes=1")
    monkeypatch.setenv("TIDE_DEBUG", "1")
    text = o.effective()
    assert "cta_split=ranges" in text and "copy_lanes=1" in text and "trace=1" in text
    for bad, msg in (("copy_lanes=9", "TIDE_EXEC_OPTIONS='copy_lanes=9': ExecutorOptions.copy_lanes: expected 1..8"),
                     ("bogus=1", "TIDE_EXEC_OPTIONS: unknown field 'bogus'"),
                     ("ranges", "TIDE_EXEC_OPTIONS: 'ranges' is not field=value"),
                     ("copy_lanes=two", "TIDE_EXEC_OPTIONS: copy_lanes: 'two' is not an integer")):
        monkeypatch.setenv("TIDE_EXEC_OPTIONS", bad)
        with pytest.raises(tide.PlanError) as info:
            o.effective()
        assert msg in str(info.value), str(info.value)
    monkeypatch.setenv("TIDE_EXEC_OPTIONS", "workers=-3")
    plan = tide.plan(tide.GroupSignature(shapes=[(8, 4)]), tide.Topology(1, 2))
    with pytest.raises(tide.PlanError, match="TIDE_EXEC_OPTIONS='workers=-3'"):
        tide.VirtualCluster(tide.Topology(1, 2)).all_gather(plan, [[[]], [[]]])


@pytest.mark.parametrize("split", ["auto", "tiles", "ranges"])
def test_cta_split_option(split):
    """ExecutorOptions.cta_split picks how SUM and REDUCE split their elements (device.cuh): auto
    runs ranges below 32 CTAs and tiles from there (a host decision: no GPU needed)."""
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build")
    for ctas, auto in ((1, "ranges"), (31, "ranges"), (32, "tiles"), (264, "tiles")):
        assert _core.cuda.split_for(ctas, {"cta_split": split}) == (auto if split == "auto" else split)


@pytest.mark.parametrize("group", ["llama70b", "qwen3", "wan22"])
def test_layout_bench_reads_the_programs_tables(group):
    """The layout bench's bytes and slot bindings come from the core's listings: the AG programs
    move 2 N S bytes per rank (direct landing: every landing byte written once, read once), and
    every slot of rank 0's SUM / LAND run tables stands for one buffer (a gradient of rank 0, or a
    rank's arena) whose span covers every run's read there."""
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build (the run tables are the CUDA executor's)")
    from tide import models
    from tide_apps.bench import layout
    L = 8
    plan = tide.plan(models.signature(layout.GROUPS[group], "block"), tide.Topology(1, L))
    NS = L * 2 * plan.layout.E
    assert layout.program_bytes(_core, _core.build_ag_programs(plan), L) == 2 * L * NS
    ps = _core.build_rs_programs(plan, bank=0, alpha=1.0 / L, accumulate=False, expert_lane=False)
    ops = layout.reduce_ops(_core, ps, 0)
    assert {o["kind"] for o in ops} == {"SUM"}  # one node: the Level-1 SUM writes the output
    for o in ops:
        n, _, fp32, runs, _, _, _, _ = o["table"]
        assert sum(ln for _, ln, _, _ in runs) == n
        src = layout.slot_sources(_core, o["table"], o["op"])
        for _, ln, slots, offs in runs:
            for t, (s, off) in enumerate(zip(slots, offs)):
                if s >= 0:
                    where, isz, lo, hi = src[s]
                    assert isz == (4 if fp32 >> t & 1 else 2) and lo <= off and off + ln * isz <= hi
                    assert where[0] == ("grad" if s < 256 else "arena")
        assert layout.table_bytes(o["table"]) >= 4 * n


def test_layout_bench_bit_diff():
    """bit_diff names the first differing element and its block row."""
    torch = pytest.importorskip("torch")
    from tide_apps.bench import layout
    want = torch.arange(32, dtype=torch.float32)
    assert layout.bit_diff(torch, want, want.clone(), 16) == (True, None)
    bad = want.clone()
    bad[17] = 5.0
    ok, d = layout.bit_diff(torch, want, bad, 16)
    assert not ok and d["count"] == 1 and d["first"] == 17 and d["block_row"] == 1 and d["got"] == 5.0


def test_native_stack_dump_on_signal():
    """cuda.install_stack_dump(sig): the signalled process writes its native backtrace to stderr
    and keeps running (the hang reports of tests/test_cuda_ipc.py and tools/gpu/hang.py)."""
    if not _core.built_with_cuda:
        pytest.skip("no CUDA build")
    import subprocess
    import sys
    code = ("import os, signal\nfrom tide import _core\n_core.cuda.install_stack_dump(signal.SIGUSR2)\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\nprint('still running')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "still running"
    assert "-- tide native stack, pid " in r.stderr, r.stderr
    frames = [ln for ln in r.stderr.splitlines() if "[0x" in ln]
    assert any("_core" in ln for ln in frames) and any("libc" in ln for ln in frames), r.stderr


def test_timeout_shorthand_and_options_agree():
    """timeout_s= is a shorthand of options["timeout_s"]: validated like it, and refused when the
    two disagree (one value per thing)."""
    args = (0, 1, 1, ["/tide_test_none"], 4096)
    with pytest.raises(tide.PlanError, match="ExecutorOptions.timeout_s"):
        _core.RankExecutor(*args, timeout_s=-1.0)
    with pytest.raises(tide.PlanError, match="timeout_s: given twice"):
        _core.RankExecutor(*args, timeout_s=2.0, options={"timeout_s": 3.0})


def test_device_of_is_cuda_only():
    vc = tide.VirtualCluster(tide.Topology(1, 2))
    with pytest.raises(tide.PlanError, match="only the CUDA backend"):
        vc.device_of(0)


def test_rail_counts_read_an_nccl_rails_host_polls():
    """handle.stats' rail counts (tide_torch.comm.rail_counts): NcclRail's properties, none for the
    CPU's gloo rail or no rail."""
    torch = pytest.importorskip("torch")  # noqa: F841 - tide_torch needs it
    from tide_torch import comm
    if _core.built_with_cuda and hasattr(_core.cuda, "NcclRail"):
        for name in ("groups", "in_progress_waits", "in_progress_wait_s"):
            assert hasattr(_core.cuda.NcclRail, name), name

    class Rail:  # the NcclRail surface rail_counts reads
        groups, in_progress_waits, in_progress_wait_s = 12, 3, 0.0004567

    assert comm.rail_counts(Rail()) == {"rail_groups": 12, "rail_host_waits": 3, "rail_host_wait_us": 456}
    assert comm.rail_counts(None) == {}
    from tide_torch.rails import GlooRail
    assert comm.rail_counts(GlooRail.__new__(GlooRail)) == {}
