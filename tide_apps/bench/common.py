"""Shared pieces of `tide bench ag|rs|interference|train`: execution context, groups, timing,
tables, JSON, plots and progress lines.

Execution contexts (the header of every table names the one used):
  cpu   no usable GPU: TIDE on the CPU virtual cluster, the stock layout steps as torch-CPU
        emulations; tiny sizes; labelled "EMULATION (CPU)".
  gpu1  one GPU: N virtual ranks of TIDE on the GPU against the stock layout steps of all N
        ranks on the same GPU; labelled "1 GPU, N virtual ranks".
  multi >= 2 GPUs: world = #GPUs; stock paths in spawned NCCL processes, TIDE from this process
        driving every GPU (CudaVirtualCluster(devices=...)).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

MIB = 1 << 20


@dataclass
class Context:
    kind: str      # "cpu" | "gpu1" | "multi"
    gpus: int
    device: str    # device name in words
    label: str     # table header line

    @property
    def emulation(self) -> bool:
        return self.kind == "cpu"


def detect_context(force: str | None = None, ranks: int = 8) -> Context:
    """The execution context: `force` ("cpu", "gpu1", "multi") or what this machine has."""
    from tide import _core
    n = _core.cuda.device_count() if (_core.built_with_cuda and _core.cuda.available()) else 0
    if force not in (None, "auto", "cpu", "gpu1", "multi"):
        raise ValueError(f"--context: expected auto, cpu, gpu1 or multi, got {force!r}")
    kind = force if force not in (None, "auto") else ("cpu" if n == 0 else "gpu1" if n == 1 else "multi")
    if kind != "cpu" and n == 0:
        raise ValueError(f"--context {kind}: no usable CUDA GPU (or tide._core is not a CUDA build)")
    if kind == "multi" and n < 2:
        raise ValueError(f"--context multi: needs >= 2 GPUs, this machine has {n}")
    if kind == "cpu":
        import platform
        return Context("cpu", 0, f"CPU ({platform.processor() or platform.machine()})",
                       f"EMULATION (CPU): TIDE on the CPU virtual cluster ({ranks} ranks), stock "
                       "layout steps emulated with torch-CPU; latencies are not GPU figures")
    import torch
    name = torch.cuda.get_device_name(0)
    if kind == "gpu1":
        return Context("gpu1", 1, name, f"1 GPU, {ranks} virtual ranks ({name}): every rank's work "
                       "on one GPU; same-GPU copies stand in for NVLink transfers")
    return Context("multi", n, name, f"{n} x {name}, world = {n} (one node); stock paths over NCCL "
                   f"{_nccl_version()}, TIDE from one process driving all GPUs")


def _nccl_version() -> str:
    try:
        import torch
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - only a label
        return "?"


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- groups --------------------------------------------------------------------------------
def group_shapes(shard_bytes: int, P: int, N: int, elem_bytes: int, cols: int = 4096) -> list[tuple]:
    """P 2-D shapes whose unsharded total is about N * shard_bytes (elements of `elem_bytes`):
    a repeating mix of large and small matrices (1, 3, 1, 2 units; like a block's q/mlp/k/o),
    rows rounded to a multiple of N so no parameter is padded."""
    if P < 1 or N < 1 or shard_bytes < elem_bytes:
        raise ValueError(f"group_shapes: need P >= 1, N >= 1, shard_bytes >= {elem_bytes} "
                         f"(got P={P}, N={N}, shard_bytes={shard_bytes})")
    total = N * shard_bytes // elem_bytes
    cols = max(1, min(cols, total // (N * P * 8)))  # >= ~8 row groups of N per unit: rounding stays small
    weights = [(1, 3, 1, 2)[i % 4] for i in range(P)]
    unit = total / sum(weights)
    shapes = []
    for w in weights:
        rows = max(N, int(round(w * unit / cols / N)) * N)
        shapes.append((rows, cols))
    return shapes


# ---- timing --------------------------------------------------------------------------------
def time_cuda(torch, fn, reps: int, warmup: int, before=None) -> list[float]:
    """Milliseconds per call of fn() on torch's current stream, CUDA events around each call;
    before(): run ahead of each timed call (outside the events), e.g. the ranks' barrier."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if before is not None:
            before()
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def time_wall(fn, reps: int, warmup: int, sync=None) -> list[float]:
    """Milliseconds per call of a synchronous fn() (TIDE's executor waits for its own streams)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def stats(ms: list[float]) -> dict:
    return dict(min_ms=min(ms), med_ms=statistics.median(ms), reps=len(ms))


def bw_columns(size_bytes: int, ms: float, n: int) -> dict:
    """nccl-tests' algbw = size / time and busbw = algbw * (n - 1) / n (AG and RS), GB/s."""
    alg = size_bytes / ms / 1e6 if ms > 0 else 0.0
    return dict(size_bytes=size_bytes, algbw=alg, busbw=alg * (n - 1) / n)


# ---- output --------------------------------------------------------------------------------
def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"


def print_table(rows: list[dict], cols: list[tuple], title: str | None = None, out=None) -> None:
    """cols: (key, header, width, format) with format a str.format spec or a callable."""
    out = out or sys.stdout
    if title:
        print(title, file=out)
    print(" ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (_, h, w, _) in enumerate(cols)), file=out)
    for r in rows:
        cells = []
        for i, (k, _, w, f) in enumerate(cols):
            v = r.get(k)
            if v is None:
                s = "-"
            elif callable(f):
                s = f(v)
            else:
                s = format(v, f)
            cells.append(f"{s:<{w}}" if i == 0 else f"{s:>{w}}")
        print(" ".join(cells), file=out)


def write_json(path: str | None, obj: dict) -> None:
    if path:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=str)
        progress(f"wrote {path}")


def bar_plot(path: str | None, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> None:
    """Grouped bars: groups[group][series] = value (e.g. {"32 MiB": {"TIDE-AG": 0.4, ...}})."""
    if not path:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = []
    for g in groups.values():
        for s in g:
            if s not in series:
                series.append(s)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(series)) / 3), 4))
    width = 0.8 / max(1, len(series))
    for j, s in enumerate(series):
        xs = [i + j * width for i in range(len(groups))]
        ys = [g.get(s, 0.0) or 0.0 for g in groups.values()]
        ax.bar(xs, ys, width, label=s)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels(list(groups))
    ax.set_ylabel(ylabel)
    import textwrap
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    if series:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no measurements (see the table's notes)", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"wrote {path}")


def add_common_args(ap) -> None:
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    ap.add_argument("--plot", default=None, metavar="PATH.png", help="draw a PNG (matplotlib)")
    ap.add_argument("--context", default="auto", choices=("auto", "cpu", "gpu1", "multi"),
                    help="auto: multi with >= 2 GPUs, gpu1 with one, cpu without")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per row (default by context)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed calls first (default by context)")


def collect(procs, q, n: int, timeout_s: float) -> list:
    """n results from spawned workers' queue q; stops early (RuntimeError) when a worker dies
    without reporting or the deadline passes; every worker is joined or killed."""
    import queue
    got, deadline = [], time.time() + timeout_s
    try:
        while len(got) < n:
            try:
                got.append(q.get(timeout=2.0))
                continue
            except queue.Empty:
                pass
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"worker {procs.index(dead[0])} exited with {dead[0].exitcode} before reporting")
            if time.time() > deadline:
                raise RuntimeError(f"workers did not report within {timeout_s:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=20 if len(got) == n else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return got


class cpu_threads:
    """CPU emulation: torch with one intra-op thread inside the block (its spinning OpenMP pool
    fights the virtual cluster's rank threads and made small CPU ops 100x slower at random)."""

    def __init__(self, context_arg):
        self.on = context_arg == "cpu"
        if not self.on and context_arg == "auto":
            from tide import _core
            self.on = not (_core.built_with_cuda and _core.cuda.available())

    def __enter__(self):
        import torch
        self.threads = torch.get_num_threads()
        if self.on:
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        import torch
        torch.set_num_threads(self.threads)


def ratio(a, b):
    return (a / b) if (a and b) else None
