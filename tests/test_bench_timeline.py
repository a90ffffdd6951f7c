"""tide_apps/bench/timeline.py: a traced step's breakdown (GPU busy by class, idle gaps attributed to
the host or to a device wait, host time in synchronizing calls, TIDE's and c10d's call time) on
synthetic Chrome traces with known answers, and `examples/fsdp2_llama.py --trace` on CPU: every
(variant, rank) writes its trace, TIDE's calls appear as tide::* ranges and stock's as c10d ops."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tide_apps.bench import timeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def X(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def _trace():
    """A 1000 us step: compute 0-100 and 300-400 (two streams overlapping 350-400 with a TIDE
    kernel 350-450), a memcpy 500-600, a layout kernel 600-650, idle 100-300 (the next kernel was
    launched at 50: a device wait), 450-500 (launched at 470: the host), 650-1000 (the end)."""
    return [
        X("bench::step", "user_annotation", 0, 1000),
        X("sgemm", "kernel", 0, 100, correlation=1), X("cudaLaunchKernel", "cuda_runtime", -10, 5, correlation=1),
        X("sgemm", "kernel", 300, 100, correlation=2), X("cudaLaunchKernel", "cuda_runtime", 50, 5, correlation=2),
        X("void tide::sum_kernel<float>", "kernel", 350, 100, correlation=3),
        X("cuLaunchKernel", "cuda_driver", 60, 4, correlation=3),
        X("Memcpy DtoD", "gpu_memcpy", 500, 100, correlation=4),
        X("cudaMemcpyAsync", "cuda_runtime", 470, 6, correlation=4),
        X("split_with_sizes_copy_out_contiguous_no_cast_kernel", "kernel", 600, 50, correlation=5),
        X("cudaLaunchKernel", "cuda_runtime", 480, 5, correlation=5),
        X("cudaStreamSynchronize", "cuda_runtime", 700, 290),
        X("cudaEventQuery", "cuda_runtime", 200, 10), X("cudaEventQuery", "cuda_runtime", 220, 10),
        X("tide::all_gather", "user_annotation", 40, 30), X("tide::reduce_scatter", "user_annotation", 460, 30),
        X("c10d::_allgather_base_", "cpu_op", 100, 20),
        X("FSDP::pre_forward", "user_annotation", 30, 50), X("FSDP::post_backward", "user_annotation", 60, 40),
        X("sgemm", "kernel", 1100, 50),  # outside the window: not counted
        {"ph": "i", "name": "marker", "ts": 10},
    ]


def test_breakdown_of_a_known_trace():
    b = timeline.breakdown(_trace())
    assert b["step_ms"] == pytest.approx(1.0)
    assert b["gpu_busy_ms"] == pytest.approx(0.4)  # 0-100, 300-450, 500-650
    assert b["compute_ms"] == pytest.approx(0.2)
    assert b["collective_ms"] == pytest.approx(0.1)
    assert b["copy_ms"] == pytest.approx(0.1)
    assert b["layout_ms"] == pytest.approx(0.05)
    assert b["gpu_idle_ms"] == pytest.approx(0.6)
    assert b["idle_wait_ms"] == pytest.approx(0.2)   # 100-300: enqueued at 50
    assert b["idle_host_ms"] == pytest.approx(0.4)   # 450-500 (enqueued at 470) + 650-1000
    assert b["waits"] == [{"at_ms": 0.1, "ms": 0.2, "then": "sgemm"}]
    assert (b["host_sync_ms"], b["host_sync_calls"]) == (pytest.approx(0.29), 1)
    assert (b["host_query_ms"], b["host_query_calls"]) == (pytest.approx(0.02), 2)
    assert b["launch_ms"] == pytest.approx((5 + 4 + 6 + 5) / 1e3)  # -10's launch lies outside
    assert (b["tide_host_ms"], b["tide_calls"]) == (pytest.approx(0.06), 2)
    assert (b["c10d_host_ms"], b["c10d_calls"]) == (pytest.approx(0.02), 1)
    assert b["fsdp_host_ms"] == pytest.approx(0.07)  # union of 30-80 and 60-100
    lines = timeline.table({"stock": b, "tide": dict(b, step_ms=0.75)})
    assert "diff (last - first)" in lines[0]
    assert any(line.startswith("step_ms") and line.rstrip().endswith("-0.250") for line in lines)


def test_a_trace_without_the_step_window_is_refused():
    with pytest.raises(ValueError, match="bench::step"):
        timeline.breakdown([X("sgemm", "kernel", 0, 10)])


def test_fsdp2_example_writes_a_trace_per_variant_and_rank(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fsdp2_llama.py"), "--device", "cpu",
                        "--world", "2", "--nodes", "1", "--steps", "4", "--warmup", "1",
                        "--variants", "stock,tide_in_place", "--trace", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "where the traced step's milliseconds go" in r.stdout
    runs = {x["name"]: x for x in json.loads(out.read_text())["runs"]}
    for v in ("stock", "tide_in_place"):
        assert len(runs[v]["breakdowns"]) == 2
        for rank, b in enumerate(runs[v]["breakdowns"]):
            assert os.path.exists(tmp_path / f"{v}.rank{rank}.json")
            assert b["step_ms"] > 0
    stock, tide = runs["stock"]["breakdowns"][0], runs["tide_in_place"]["breakdowns"][0]
    # TIDE served the traced step: its calls are tide::* ranges and no c10d collective ran in it
    # (the loss's all-reduce comes after the step's window); stock's are c10d ops.
    assert tide["tide_calls"] > 0 and tide["c10d_calls"] == 0
    assert stock["tide_calls"] == 0 and stock["c10d_calls"] > 0
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fsdp2_llama.py"), "--device", "cpu",
                        "--steps", "2", "--warmup", "1", "--trace", str(tmp_path)],
                       check=True, capture_output=True, timeout=120, cwd=ROOT)
