"""Where a training step's milliseconds go: a breakdown of one step's torch.profiler trace.

`tide bench train --trace DIR` (examples/fsdp2_llama.py --trace DIR) profiles one timed step of
every variant on every rank with CPU and CUDA activities, writes its Chrome trace to
``DIR/<variant>.rank<r>.json`` and reduces it here to one breakdown per (variant, rank):

- ``step_ms``: the step's window, the ``bench::step`` annotation around forward, backward,
  optimizer step and the closing synchronize.
- GPU busy, the union of the device's activity intervals inside the window, split by what ran:
  ``compute`` (every other kernel), ``collective`` (NCCL's kernels and TIDE's: names with
  ``nccl`` or ``tide``), ``layout`` (FSDP2's copy-in / copy-out / pack kernels:
  ``split_with_sizes``, ``chunk_cat``, ``CatArrayBatchedCopy``) and ``copy`` (memcpy / memset:
  TIDE's copy-engine transfers, FSDP2's copy-in by ``copy_``). Each class's union is reported;
  the classes overlap where two streams run at once, ``gpu_busy_ms`` is the union of all.
- ``gpu_idle_ms``: the window minus GPU busy. Each idle gap of at least ``GAP_MS`` is attributed by
  the activity that ends it: ``host`` when that activity's launch (its runtime/driver call,
  matched by correlation id) began after the gap opened — the device waited for the host to
  enqueue — else ``wait`` — the work was enqueued in time and the device waited on a dependency:
  an event of another stream, a stream-memory wait on a peer's counter (TIDE), a peer's NCCL
  progress. ``waits`` lists the wait gaps (start offset in the step, length, the op that ends it).
- Host: ``host_sync_ms`` / ``host_sync_calls``, time inside synchronizing CUDA calls (stream,
  event, device, context synchronize) and ``host_query_ms`` / ``host_query_calls`` (event and
  stream queries: a polling host); ``launch_ms``, every other runtime/driver call;
  ``tide_host_ms`` / ``tide_calls``, the ``tide::*`` annotations (tide_torch's TIDE-AG / TIDE-RS
  calls, enqueue included); ``c10d_host_ms`` / ``c10d_calls``, torch's ``c10d::*`` collective
  ops (stock's NCCL or gloo calls); ``fsdp_host_ms``, the union of FSDP2's ``FSDP::*`` ranges
  (TIDE's calls run inside them).

Stdlib only: a trace file is JSON, so the breakdown is tested on CPU with synthetic traces.
"""
from __future__ import annotations

import json
import re

STEP_ANNOTATION = "bench::step"
GAP_MS = 0.05
SYNC = re.compile(r"^(cuda|cu)(Stream|Event|Device|Ctx)Synchronize")
QUERY = re.compile(r"^(cuda|cu)(Stream|Event)Query")
COLLECTIVE = re.compile(r"nccl|tide", re.I)
LAYOUT = re.compile(r"split_with_sizes|chunk_cat|CatArrayBatchedCopy", re.I)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


def load(path: str) -> list[dict]:
    with open(path) as f:
        obj = json.load(f)
    return obj["traceEvents"] if isinstance(obj, dict) else obj


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _clip(a: float, b: float, lo: float, hi: float):
    a, b = max(a, lo), min(b, hi)
    return (a, b) if b > a else None


def gpu_class(ev: dict) -> str:
    if ev.get("cat") != "kernel":
        return "copy"
    name = ev.get("name", "")
    if LAYOUT.search(name):
        return "layout"
    return "collective" if COLLECTIVE.search(name) else "compute"


def breakdown(events: list[dict], annotation: str = STEP_ANNOTATION) -> dict:
    """One step's breakdown (module docstring) from a Chrome trace's events, in milliseconds.
    Raises ValueError when the trace has no `annotation` window."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    wins = [e for e in xs if e.get("name") == annotation and e.get("cat") == "user_annotation"]
    if not wins:
        raise ValueError(f"the trace has no {annotation!r} annotation (the step's window)")
    w = max(wins, key=lambda e: e["dur"])
    lo, hi = float(w["ts"]), float(w["ts"]) + float(w["dur"])
    launches = {}
    for e in xs:
        if e.get("cat") in API_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    gpu, by_class = [], {"compute": [], "collective": [], "layout": [], "copy": []}
    for e in xs:
        if e.get("cat") not in GPU_CATS:
            continue
        c = _clip(float(e["ts"]), float(e["ts"]) + float(e["dur"]), lo, hi)
        if c is None:
            continue
        gpu.append((c[0], c[1], e))
        by_class[gpu_class(e)].append(c)
    busy = _union([(a, b) for a, b, _ in gpu])
    out = {"step_ms": (hi - lo) / 1e3, "gpu_busy_ms": _length(busy) / 1e3}
    for k, iv in by_class.items():
        out[f"{k}_ms"] = _length(_union(iv)) / 1e3
    out["gpu_idle_ms"] = out["step_ms"] - out["gpu_busy_ms"]
    # Idle gaps, each attributed by the activity that closes it.
    starts = sorted(gpu, key=lambda t: t[0])
    gaps, cursor = [], lo
    for a, b in busy + [(hi, hi)]:
        if a - cursor >= GAP_MS * 1e3:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
    host_ms = wait_ms = 0.0
    waits = []
    i = 0
    for g0, g1 in gaps:
        while i < len(starts) and starts[i][0] < g1:
            i += 1
        closer = starts[i][2] if i < len(starts) and starts[i][0] == g1 else None
        launched = launches.get(closer.get("args", {}).get("correlation")) if closer else None
        if closer is None or (launched is not None and launched > g0):
            host_ms += g1 - g0  # the step's end, or the host enqueued the next op late
        else:
            wait_ms += g1 - g0
            waits.append({"at_ms": round((g0 - lo) / 1e3, 4), "ms": round((g1 - g0) / 1e3, 4),
                          "then": closer.get("name", "")[:80]})
    out["idle_host_ms"], out["idle_wait_ms"] = host_ms / 1e3, wait_ms / 1e3
    out["waits"] = sorted(waits, key=lambda d: -d["ms"])
    # Host side.
    inside = [e for e in xs if lo <= float(e["ts"]) < hi]
    api = [e for e in inside if e.get("cat") in API_CATS]
    sync = [e for e in api if SYNC.match(e.get("name", ""))]
    query = [e for e in api if QUERY.match(e.get("name", ""))]
    out["host_sync_ms"], out["host_sync_calls"] = sum(e["dur"] for e in sync) / 1e3, len(sync)
    out["host_query_ms"], out["host_query_calls"] = sum(e["dur"] for e in query) / 1e3, len(query)
    out["launch_ms"] = (sum(e["dur"] for e in api) - sum(e["dur"] for e in sync + query)) / 1e3
    tide = [e for e in inside if e.get("cat") == "user_annotation" and e.get("name", "").startswith("tide::")]
    out["tide_host_ms"], out["tide_calls"] = sum(e["dur"] for e in tide) / 1e3, len(tide)
    c10d = [e for e in inside if e.get("cat") == "cpu_op" and e.get("name", "").startswith("c10d::")]
    out["c10d_host_ms"], out["c10d_calls"] = sum(e["dur"] for e in c10d) / 1e3, len(c10d)
    fsdp = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in inside
                   if e.get("cat") in ("cpu_op", "user_annotation") and e.get("name", "").startswith("FSDP::")])
    out["fsdp_host_ms"] = _length(fsdp) / 1e3
    return out


def breakdown_file(path: str) -> dict:
    return breakdown(load(path))


ROWS = ("step_ms", "gpu_busy_ms", "compute_ms", "collective_ms", "layout_ms", "copy_ms", "gpu_idle_ms",
        "idle_host_ms", "idle_wait_ms", "host_sync_ms", "host_sync_calls", "host_query_ms",
        "host_query_calls", "launch_ms", "tide_host_ms", "tide_calls", "c10d_host_ms", "c10d_calls", "fsdp_host_ms")


def table(rows: dict) -> list[str]:
    """Lines: one column per (variant, rank) breakdown of `rows` ({label: breakdown}), the first
    label's column the reference; the last column is the difference last - first."""
    labels = list(rows)
    head = f"{'':18s}" + "".join(f"{lab:>22s}" for lab in labels)
    if len(labels) > 1:
        head += f"{'diff (last - first)':>22s}"
    lines = [head]
    for k in ROWS:
        vals = [rows[lab].get(k) for lab in labels]
        fmt = (lambda v: f"{v:22d}") if k.endswith("calls") else (lambda v: f"{v:22.3f}")
        line = f"{k:18s}" + "".join(fmt(v) if v is not None else f"{'-':>22s}" for v in vals)
        if len(labels) > 1 and None not in (vals[0], vals[-1]):
            line += fmt(vals[-1] - vals[0])
        lines.append(line)
    for lab in labels:
        top = rows[lab].get("waits", [])[:5]
        if top:
            lines.append(f"{lab}: longest device waits: " + "; ".join(
                f"{w['ms']:.3f} ms at +{w['at_ms']:.3f} before {w['then']}" for w in top))
    return lines
