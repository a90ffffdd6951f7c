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
