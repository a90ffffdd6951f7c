#!/usr/bin/env python3
"""The GPU machine's one runner: named stages, run in the order given, a short summary table LAST.

    python3 tools/gpu/run.py                                  # the `check` group
    python3 tools/gpu/run.py build smoke suite bench:layout   # stages and groups, in order
    python3 tools/gpu/run.py base suite:400                   # NAME:SECONDS overrides a limit
    python3 tools/gpu/run.py --multi                          # the multi-GPU runs (>= 2 GPUs)
    python3 tools/gpu/run.py --list | --dry-run [STAGES]      # the table | commands, nothing run
    python3 tools/gpu/run.py --args 'suite=-k "reduce or land"' suite

A stage is the build, pytest runs selected by marker / paths / -k, `tide bench` commands, the
examples' comparisons, compute-sanitizer on a small case or the kernel-attribute check; every one
is defined in stage_table() below, the only place that says what runs. Contract, shaped by the
device tool that runs this on the GPU machine:
- At most 8 files come back from $OUT (default ./gpu_out): run.log (every stage's full output, in
  order), build.log (the compiler output with ptxas' registers and spills), results.json (each
  stage's verdict and every bench's / example's JSON); PNGs only with --plots.
- Only stdout's tail comes back: stdout gets one line per step, the last lines of a failing step
  and the summary table (stage, PASS/FAIL/SKIP, seconds, one line of detail), printed LAST.
- One call may run 10 minutes: every stage has a limit (NAME:SECONDS overrides it) and is killed
  at it (its process group: SIGTERM, SIGKILL 10 s later), the runner goes on with the next one;
  the run's budget (--budget, default 570 s) shortens or skips stages so that the summary is
  printed before the call is cut.
- Multicast stays off (docs/architecture.md, Safety): SAFETY below is the one place that sets the
  variables, for every child; the runner refuses to start when the caller set one of them
  otherwise or set TIDE_ENABLE_MULTICAST at all.
Stdlib only: it runs under the GPU machine's python3 (torch, pytest), which runs the stages too.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
SAFETY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MULTICAST_GATE = "TIDE_ENABLE_MULTICAST"  # unset for every child; refused when the caller set it
# Defaults a caller may override. Many ranks' streams share one GPU: every hardware queue (the
# executor's enqueue order is deadlock-free for any mapping, executor.h [Note: enqueue order]);
# XLA must not grab the GPU's memory that torch tests and TIDE arenas (cudaMalloc) share.
# bench:layout unsets CUDA_DEVICE_MAX_CONNECTIONS: its numbers are taken at the driver's default.
DEFAULTS = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
BUDGET_S = 570
KILL_GRACE_S = 10
FAIL_TAIL = 40


@dataclass
class Step:
    name: str
    cmd: list
    limit: int                       # seconds: this command's own timeout
    kind: str = "cmd"                # cmd: PASS on rc 0; pytest: and a test passed; info: never fails
    env: dict = field(default_factory=dict)
    unset: tuple = ()
    may_skip: bool = False           # pytest: "all skipped" is SKIP (needs more GPUs), not FAIL
    json: Optional[str] = None       # the command writes this JSON: merged into results.json
    detail: Optional[Callable] = None  # (output, json) -> str or (status, str)
    show: Optional[Callable] = None    # output -> lines for stdout
    drop: Optional[str] = None       # regex: output lines not logged
    skip: Optional[str] = None       # reason this step does not run here
    on_fail: Optional["Step"] = None  # runs after this step fails (e.g. a debugger backtrace)
    key: bool = False                # its detail gets its own summary line


@dataclass
class Stage:
    name: str
    limit: int
    steps: list
    doc: str
    needs: tuple = ()                # stages that must have passed when they ran in this call
    pre: Optional[Callable] = None   # (ctx, log) before the steps
    post: Optional[Callable] = None  # (ctx, log) -> extra detail, after the steps


@dataclass
class Ctx:
    out: Path
    tmp: Path
    py: str
    ngpu: int
    multi: bool = False
    plots: bool = False
    tree: str = "?"  # --tree, else "git HEAD <id> (a copied tree may be newer)"
    environ: dict = field(default_factory=lambda: dict(os.environ))


# ---- details: one line out of a step's output or JSON ------------------------------------------
def last_line(text, _d=None):
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return re.sub(r"=+", "", lines[-1]).strip() if lines else ""


def grep_last(pattern):
    return lambda text, _d=None: next((ln.replace("=", "").strip() for ln in reversed(text.splitlines())
                                       if re.search(pattern, ln)), "")


def grep_lines(pattern, n, invert=False):
    return lambda text: [ln for ln in text.splitlines() if bool(re.search(pattern, ln)) != invert][-n:]


def d_graphdiag(text, _d=None):
    """graphdiag.py's verdicts: PASS when every variant stayed bitwise equal to stock."""
    rows = [ln.split(None, 2) for ln in text.splitlines() if ln.startswith("graphdiag ")]
    got = {r[1]: r[2] for r in rows if len(r) == 3 and not r[2].startswith("stats")}
    bad = sorted(v for v, line in got.items() if not line.startswith("bitwise"))
    if not got:
        return "FAIL", "no verdict line (graphdiag.py did not finish a variant)"
    return ("PASS" if not bad else "FAIL",
            f"{len(got)} variants" + (f", differ: {', '.join(bad)}" if bad else ", all bitwise vs stock"))


def d_collective(_t, d):
    rows = [r for r in d["rows"] if r["path"].startswith("TIDE") and "med_ms" in r]
    bad = [r["path"] for r in rows if not (r.get("check") == "bitwise" or r.get("rel_err", 1) < 1e-2)]
    tg = ", ".join(f"{t['shard_mib']:g} MiB {t['value']:.2f}x {'met' if t['met'] else 'NOT met'}"
                   for t in d.get("targets", []))
    return ("PASS" if rows and not bad else "FAIL",
            f"{len(rows)} TIDE rows, checks {'ok' if not bad else 'FAILED: ' + ', '.join(bad)}"
            + (f"; targets {tg}" if tg else ""))


def d_interference(_t, d):
    ok = all("alone_ms" in r for r in d["rows"] if not r.get("note"))
    t = d.get("target")
    return ("PASS" if ok else "FAIL", f"{t['target']}: {t['value']:+.1f}% ({'met' if t['met'] else 'NOT met'}); beside: "
            + ", ".join(f"{k} {x:+.1f}%" for k, x in t.get("stock_beside", {}).items()) if t else f"{len(d['rows'])} rows")


def d_train(_t, d):
    notes = [r["note"] for r in d["rows"] if r.get("note")]
    return ("FAIL", "; ".join(notes)[:160]) if notes else ("PASS", f"{len(d['rows'])} runs")


def d_ratio(goal):
    """The step-ratio check of tide bench train (a benchmark, not a timed unit test): FAIL when
    TIDE In-Place's step is above `goal` x stock's on the run, or a run is missing."""
    def detail(_t, d):
        rows = {r["run"]: r for r in d["rows"] if r.get("framework") == "torch" and "run" in r}
        notes = [r["note"] for r in d["rows"] if r.get("note")]
        if notes or "tide_in_place" not in rows or "stock" not in rows:
            return "FAIL", ("; ".join(notes) or f"runs {sorted(rows)}")[:160]
        ratio = rows["tide_in_place"]["step_ms"] / rows["stock"]["step_ms"]
        return ("PASS" if ratio <= goal else "FAIL",
                f"In-Place {rows['tide_in_place']['step_ms']:.1f} ms / stock {rows['stock']['step_ms']:.1f} ms = "
                f"{ratio:.2f}x (goal <= {goal})")
    return detail


def d_ceproof(_t, d):
    r = d["rows"][0]
    v = d.get("verdict")
    return ("FAIL" if v == "FAIL" else "INFO" if v == "INFO" else "PASS",
            f"{d.get('label')}: rank 0 rows at GPU 1 after {r.get('arrival_s')} s, spinner ended {r.get('spinner_end_s')} s")


def d_fsdp2(_t, d):
    return f"{d['device']}, world {d['world']}: " + "; ".join(
        f"{r['name']} {r['step_ms']:.2f} ms {r['peak_bytes'] / 2**30:.2f} GiB loss {r['final_loss']:.4f}" for r in d["runs"])


def d_flax(_t, d):
    return f"{d['device']} x{d['world']}: " + ", ".join(
        f"{r['name']} {r['step_ms']:.2f} ms/step loss {r['final_loss']:.3f}" for r in d["runs"])


def d_hostcall(_t, d):
    return ", ".join(f"{w.upper()} median {d[w]['median_us']:.0f} us p90 {d[w]['p90_us']:.0f} us"
                     + (f" (stock {d['stock_' + w]['median_us']:.0f} / {d['stock_' + w]['p90_us']:.0f} us, "
                        f"{d[w]['ratio_to_stock']:.2f}x)" if "stock_" + w in d else "") for w in ("ag", "rs"))


# ---- the build's workarounds (gpu machine image) -----------------------------------------------
def probe(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def link_flags():
    """[Note: libstdc++ in _core] A module built on the GPU machine once carried its own exported
    copy of libstdc++ and crashed in the first std::ostringstream number insertion (two copies'
    locale state mixed). Hide every static archive's symbols; and where the image lacks the
    libstdc++.so dev symlink (-lstdc++ would silently take libstdc++.a) point the linker at the
    shared one. Returns (LDFLAGS, the libstdc++.so.6 to link or None)."""
    flags = "-Wl,--exclude-libs,ALL"
    if probe(["c++", "-print-file-name=libstdc++.so"]).startswith("/"):
        return flags, None
    so6 = next((ln.split()[-1] for ln in probe(["ldconfig", "-p"]).splitlines()
                if re.search(r"libstdc\+\+\.so\.6 .*x86-64", ln)), None)
    return (f"{flags} -L{ROOT}/build/linkfix", so6) if so6 else (flags, None)


def build_pre(c, log):
    log("== toolchain")
    for cmd, pick in ((["c++", "--version"], 0), (["cmake", "--version"], 0), (["nvcc", "--version"], -1)):
        out = probe(cmd).splitlines()
        log(out[pick] if out else f"{cmd[0]}: not found")
    log(f"libstdc++.so: {probe(['c++', '-print-file-name=libstdc++.so'])}  "
        f"libstdc++.a: {probe(['c++', '-print-file-name=libstdc++.a'])}")
    for k in ("CC", "CXX", "CUDACXX", "LDFLAGS", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "CUDAFLAGS", "LIBRARY_PATH"):
        if k in c.environ:
            log(f"{k}={c.environ[k]}")
    shutil.rmtree(ROOT / "build" / "inplace", ignore_errors=True)
    _flags, so6 = link_flags()
    if so6:
        (ROOT / "build" / "linkfix").mkdir(parents=True, exist_ok=True)
        link = ROOT / "build" / "linkfix" / "libstdc++.so"
        link.unlink(missing_ok=True)
        link.symlink_to(so6)
        log(f"libstdc++.so dev symlink missing: linking {so6}")


def build_post(c, log):
    so = sorted((ROOT / "tide").glob("_core*.so"))
    if not so:
        return "no tide/_core*.so"
    syms = probe(["bash", "-c", f"nm -D --defined-only {shlex.quote(str(so[0]))} | c++filt | grep -c ' std::'"])
    log(f"== ldd {so[0]}\n{probe(['ldd', str(so[0])])}")
    log(f"== _M_insert<long> in _core\n{probe(['bash', '-c', f'nm -DC {shlex.quote(str(so[0]))} | grep _M_insert.long.'])}")
    return f"{syms or '?'} exported std:: symbols"


SMOKE = ("from tide import _core; _core.cuda.available(); import numpy, ml_dtypes, torch; import tide; "
         "p = tide.plan(tide.GroupSignature(shapes=[(37, 16), (5,)]), tide.Topology(1, 1)); "
         'print("plan ok", hex(p.hash))')
TORCHGPU_TESTS = ("test_world1_cuda test_world1_cuda_nccl_fabric test_world2_one_gpu_ipc test_world2_two_gpus_nccl "
                  "test_world2_two_gpus_nccl_fabric test_world1_cpu test_world2_cpu test_cuda_transport_calls "
                  "test_nccl_arena_calls test_world1_keeps_stock_by_default").split()
XLA_CPU_TESTS = ["tests/test_xla_ffi.py", "tests/test_xla_all_gather.py", "tests/test_xla_grads.py",
                 "tests/test_xla_shard.py", "tests/test_xla_virtual.py"]
EXAMPLECMP = [("ipc", {}, "ipc"), ("nccl", {}, "nccl"), ("ipc_lanes1", {"TIDE_EXEC_OPTIONS": "copy_lanes=1"}, "ipc"),
              ("ipc_2d_per_copy", {"TIDE_EXEC_OPTIONS": "copy_2d=per_copy"}, "ipc")]


# ---- THE STAGE TABLE: every command the runner can run -----------------------------------------
def stage_table(c: Ctx) -> dict:
    py, out = c.py, str(c.out)
    lim = lambda one, more: more if c.ngpu >= 2 else one  # noqa: E731 - spawned NCCL ranks start slower
    Q = ["-q", "-p", "no:cacheprovider"]
    TO = ["--timeout=90", "--timeout-method=thread"]

    def pytest(name, *args, limit, **kw):
        return Step(name, [py, "-m", "pytest", *args], limit, kind="pytest", **kw)

    def js(stage, step):
        return str(c.tmp / f"{stage}_{step}.json".replace(":", "_"))

    def bench(stage, *args, limit, detail=None, png=None, **kw):
        j = str(c.tmp / (stage.replace(":", "_") + ".json"))
        plot = ["--plot", f"{out}/{png}.png"] if c.plots and png else []
        return Step(stage.split(":")[1], [py, "-m", "tide_apps", "bench", *args, "--json", j, *plot], limit, json=j,
                    detail=detail, **kw)

    def fsdp2(name, launcher, size, steps, fabric, limit, env=None, detail=d_fsdp2, show=None):
        j = js("ex", name)
        return Step(name, [*launcher, "examples/fsdp2_llama.py", "--device", "cuda", "--size", size, "--steps", str(steps),
                           "--fabric", fabric, "--json", j], limit, env=env or {}, json=j, detail=detail, show=show,
                    key=True)

    topo = ["--topologies", "1x8,2x4,4x2,8x1"] if c.multi and c.ngpu == 8 else []  # emulated node splits
    nccl_ctas = "default,8,4" if c.multi and c.ngpu == 8 else "default"          # NCCL default, <= 8, <= 4 CTAs
    tg_tests = ["test_world2_two_gpus_nccl", "test_world2_one_gpu_ipc"] if c.multi else TORCHGPU_TESTS
    tg_size, tg_steps = ("1b", 8) if c.multi else ("small", 10)
    sanitizer = None if shutil.which("compute-sanitizer") else "no compute-sanitizer on this machine"
    ldflags, _ = link_flags()
    core = 'from tide import _core; print("built_with_cuda", _core.built_with_cuda, "devices", _core.cuda.device_count()'
    stages = [
        Stage("build", 300, [Step("build", ["bash", "tools/build.sh"], 300, unset=("CFLAGS", "CXXFLAGS", "CPPFLAGS", "CUDAFLAGS"),
                                  env={"LDFLAGS": ldflags, "TIDE_CUDA": "on", "PYTHON": py, "CMAKE_BUILD_TYPE": "Release",
                                       "BUILD_LOG": f"{out}/build.log"},
                                  detail=lambda t, _d: last_line(t).split(" -- full log")[0])],
              "rm -rf build/inplace; tools/build.sh with CUDA on, a clean flag environment, hidden static symbols",
              pre=build_pre, post=build_post),
        Stage("prebuilt", 60, [Step("prebuilt", [py, "-c", PREBUILT], 60, detail=last_line)],
              "instead of build: the core built on the CPU machine and carried (tide/_core*.so, "
              "tide_xla/_ffi*.so) loads here with CUDA"),
        Stage("smoke", 240, [Step("plan", [py, "-X", "faulthandler", "-c", SMOKE], 120, on_fail=Step(
            "cuda-gdb", ["cuda-gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt", "--args",
                         py, "-c", SMOKE], 120, kind="info", drop=r"New Thread|exited\]",
            skip=None if shutil.which("cuda-gdb") else "no cuda-gdb"))],
              "plan one group through tide._core next to torch (a crash: cuda-gdb backtrace; there is no gdb)"),
        Stage("kernels", 240, [pytest("kernels", *Q, "tests/test_cuda_kernels.py", "-rs", *TO, limit=240)],
              "CUDA kernel tests"),
        Stage("executor", 240, [pytest("executor", *Q, "-x", "tests/test_cuda_executor.py", "tests/test_cuda_hardening.py",
                                          "-rs", *TO, limit=240)],
              "CUDA executor bitwise vs the CPU executor, faults, the staging canary", needs=("smoke",)),
        Stage("demo", 120, [Step("demo", [py, "-m", "tide_apps", "demo"], 120, detail=grep_last("Agreement check"),
                                 show=lambda t: t.splitlines()[:4])],
              "`tide demo` on the GPU (README's first command)", needs=("smoke",)),
        Stage("sanitize", 240, [Step(tool, ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", py,
                                            "tools/gpu/sanitize_case.py"], 120, skip=sanitizer,
                                     detail=grep_last("ERROR SUMMARY|RACECHECK SUMMARY"), key=True)
                                for tool in ("memcheck", "racecheck")],
              "compute-sanitizer memcheck and racecheck on tools/gpu/sanitize_case.py (no framework)"),
        Stage("kperf", 60, [Step("kperf", [py, "tools/gpu/kperf.py", f"{out}/build.log", "build/build.log"], 60)],
              "registers and spills: ptxas -v in the build log, the loaded SUM/REDUCE kernels"),
        Stage("suite", 300, [pytest("suite", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rs", "--durations=12",
                                    "--timeout=240", "--timeout-method=thread", "tests/", limit=300,
                                    show=grep_lines(r" PASSED( |$)", 40, invert=True))],
              "every GPU-marked test: pytest -m gpu tests/ (--args 'suite=-k EXPR' selects)"),
        # The suite in two halves that together are `suite`, for calls too short for the whole one
        # (it outlasts a 570 s call with the build): the tide_torch files, then every other file.
        Stage("suite_torch", 300, [pytest("suite_torch", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rs",
                                          "--durations=8", "--timeout=240", "--timeout-method=thread",
                                          *sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_torch_*.py")),
                                          limit=300, show=grep_lines(r" PASSED( |$)", 40, invert=True))],
              "the suite's first half: GPU-marked tests of tests/test_torch_*.py"),
        Stage("suite_rest", 300, [pytest("suite_rest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rs",
                                         "--durations=8", "--timeout=240", "--timeout-method=thread",
                                         "--ignore-glob=tests/test_torch_*.py", "tests/", limit=300,
                                         show=grep_lines(r" PASSED( |$)", 40, invert=True))],
              "the suite's second half: GPU-marked tests of every other file (XLA, CUDA, NCCL, benches)"),
        Stage("graphdiag", 200, [Step("graphdiag", [py, "tools/gpu/graphdiag.py"], 200, detail=d_graphdiag,
                                      show=grep_lines(r"^graphdiag", 12), key=True)],
              "replayed calls (graphs) vs eager vs stock FSDP2, world 2 on one GPU, step by step "
              "(tools/gpu/graphdiag.py; FAIL names the variants that differ)"),
        Stage("cudaipc", 150, [
            Step("diag", [py, "-c", core + "); print(_core.cuda.capabilities(0))"], 60, kind="info"),
            pytest("cuda_ipc", "-q", "-rs", "-x", "-m", "gpu", "tests/test_cuda_ipc.py", limit=240),
            pytest("cuda_executor_regression", "-q", "-rs", "-x", "-m", "gpu", "tests/test_cuda_executor.py", limit=300),
            pytest("nogpu_surface", "-q", "-rs", "-x", "tests/test_cuda_backend_nogpu.py", limit=60)],
              "CudaRankExecutor over the CUDA-IPC fabric (spread-over-GPU cases need 2 GPUs), then regressions"),
        Stage("rails", 240, [
            pytest("rails_ipc", "-q", "-rs", "-x", "-m", "gpu", "tests/test_cuda_ipc.py", "-k", "two_sided", limit=200),
            pytest("rails_torch", "-q", "-s", "-rs", "-x", "-m", "gpu",
                   "tests/test_torch_gpu.py::test_emulated_hosts_2x2_rails", limit=200,
                   show=grep_lines(r"^rails:|passed|failed", 6))],
              "two-sided rails on emulated hosts (one NCCL_HOSTID per process, NET/Socket on loopback): the CUDA "
              "rank executor's AG/RS vs the CPU VirtualCluster, a dead peer, tide_torch 2 x 2 vs stock FSDP2"),
        Stage("matrix", 300, [
            pytest("matrix_gpu", "-q", "-s", "-rs", "-x", "-m", "gpu", "tests/test_torch_matrix_gpu.py", limit=300,
                   show=grep_lines(r"^matrix:|passed|failed", 8))],
              "the configuration matrix's rows (nn.RMSNorm, bf16 reduce, TP + FSDP) on 2 x 2 emulated hosts, "
              "bitwise vs stock FSDP2"),
        Stage("nccl", 150, [
            Step("diag", [py, "-c", core + ', "nccl headers", _core.cuda.nccl_header_version()); '
                          'print("nccl", _core.cuda.nccl_version(), _core.cuda.nccl_library_path())'], 60, kind="info"),
            pytest("nccl_fabric_gpu", "-q", "-rs", "-m", "gpu", "tests/test_nccl_fabric.py", limit=300),
            pytest("nccl_fabric_cpu", "-q", "-rs", "-m", "not gpu", "tests/test_nccl_fabric.py", limit=120)],
              "the NCCL fabric: world 1 on GPU 0, world 2 with 2 GPUs; the file's CPU tests"),
        Stage("torchgpu", 150, [
            Step("caps", [py, "-c", 'import torch, tide; from tide_torch import comm; print(torch.cuda.device_count(), '
                          '"GPU(s); cuda.RankExecutor", hasattr(tide._core.cuda, "RankExecutor"), "cuda.IpcFabric", '
                          'hasattr(tide._core.cuda, "IpcFabric"), "cuda.available", tide._core.cuda.available())'],
                 60, kind="info"),
            *[pytest(t, *Q, "-rs", f"tests/test_torch_gpu.py::{t}", limit=900, may_skip=c.ngpu < 1 or "two_gpus" in t)
              for t in tg_tests],
            fsdp2(f"example_1gpu_{tg_size}", [py], tg_size, tg_steps, "auto", 900,
                  show=grep_lines(r"^(cpu|NVIDIA|stock|tide_|max \||  .*fallbacks)", 20)),
            Step(f"example_2gpu_{tg_size}", [], 900, skip=f"{c.ngpu} GPU visible") if c.ngpu < 2 else
            fsdp2(f"example_2gpu_{tg_size}", [py, "-m", "torch.distributed.run", "--nproc-per-node", "2"], tg_size,
                  tg_steps, "auto", 900)],
              "tide_torch's CUDA path: tests/test_torch_gpu.py one test per pytest, examples/fsdp2_llama.py on "
              "1 GPU and under torchrun on 2"),
        Stage("xlacuda", 150, [
            Step("env", [py, "-c", 'import jax, tide_xla._ffi as f; print("jax", jax.__version__, jax.devices(), '
                         '"ffi cuda", f.built_with_cuda)'], 60, kind="info"),
            pytest("gpu_tests", "-q", "-rs", "tests/test_xla_gpu.py", limit=900),
            pytest("gpu_tests_sync", "-q", "-x", "tests/test_xla_gpu.py", "-k", "virtual or one_gpu", limit=900,
                   env={"TIDE_EXEC_OPTIONS": "sync_every_call=1"}),
            pytest("cpu_xla_tests", "-q", *XLA_CPU_TESTS, limit=900,
                   env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}),
            Step("example", [py, "examples/flax_fsdp.py", "--steps", "30", "--separate", "--json", js("xla", "flax")],
                 900, json=js("xla", "flax"), detail=d_flax, key=True)],
              "tide_xla on CUDA: the FFI handlers' GPU tests (and synchronised), the CPU xla tests, the Flax example"),
        Stage("xlaproc", 420, [
            pytest("xla_processes", "-q", "-rs", "-x", "-m", "gpu", "tests/test_xla_gpu_processes.py", limit=300),
            pytest("host_processes", "-q", "-rs", "-x", "-m", "gpu", "tests/test_cuda_host_processes.py", limit=240),
            *[bench(f"bench:train_shared{n}x{m}", "train", "--shared-gpu", str(n), "--nodes", str(m), "--steps", "6",
                    "--timeout", "150", limit=330, png=f"train_shared{n}x{m}", detail=d_train,
                    show=grep_lines(r"^(model|fw|torch|jax) ", 12))
              for n, m in ((2, 2), (4, 2))]],
              "tide_xla across processes on CUDA: 2 and 4 processes sharing the GPU (emulated hosts: IPC in a node, "
              "NCCL rails across) bitwise vs the CPU; 2 processes x 2 in-process ranks on the core's path; tide bench train with both frameworks on those processes"),
        *[Stage(f"ratio:{size}", 560, [
            bench(f"ratio:{size}_{n}x{m}", "train", "--frameworks", "torch", "--size", size, "--shared-gpu", str(n),
                  "--nodes", str(m), "--steps", "8", "--timeout", "170", "--torch-args", "--variants stock,tide_in_place",
                  limit=180, detail=d_ratio(goal), show=grep_lines(r"^(model|fw|torch) ", 6))
            for n, m in ((2, 1), (2, 2), (4, 2))],
                "TIDE In-Place's training step against stock's on processes sharing the GPU (emulated hosts), "
                f"{size} preset: FAIL above {goal}x stock's step")
          for size, goal in (("tiny", 1.0), ("small", 0.9))],
        Stage("examplecmp", 150, [fsdp2(n, [py], "small", 10, fabric, 300, env=e,
                                        detail=lambda t, d: "; ".join(f"{r['name']} {r['step_ms']:.2f} ms "
                                                                      f"{r['peak_bytes'] / 2**30:.2f} GiB" for r in d["runs"]))
                                  for n, e, fabric in EXAMPLECMP],
              "examples/fsdp2_llama.py on one GPU under executor settings side by side (stock re-measured each run)"),
        Stage("graphs", 240, [pytest("replays", "-q", "-rs", "-m", "gpu", "-k", "replayed or world2_one_gpu_ipc",
                                     "tests/test_cuda_ipc.py", "tests/test_cuda_executor.py", "tests/test_torch_gpu.py",
                                     limit=150),
                              Step("example", [py, "examples/fsdp2_llama.py", "--world", "2", "--shared-gpu", "--variants",
                                               "stock,tide_in_place,tide_in_place_graphs", "--steps", "8"], 120,
                                   detail=lambda t, _d: "; ".join(" ".join(ln.split()[:4]) for ln in
                                                                  grep_lines(r"^(stock|tide_\w+) +step ", 3)(t)),
                                   show=grep_lines(r"bitwise equal|calls: ", 4))],
              "calls replayed as CUDA graphs (exec/cuda/graph.h): the replay tests (IPC, rails, in-process cluster, "
              "a dead peer, FSDP2 on one GPU), then the FSDP2 example on 2 processes sharing the GPU, eager and replayed beside stock"),
        Stage("hang", 150, [Step("hang", [py, "tools/gpu/hang.py", "--reps", "6", "--dump-after", "20", "--timeout", "240"],
                                 150, env={"TIDE_TEST_HANG_S": c.environ.get("TIDE_TEST_HANG_S", "30")},
                                 detail=grep_last(r"^passed \d+, failed"))],
              "repeat the dead-peer IPC test to catch a rare hang; stacks before its deadline (tools/gpu/hang.py)"),
        Stage("hostdiag", 420, [Step("hostdiag", [py, "tools/gpu/host_processes_diag.py"], 420,
                                     show=grep_lines(r"^(variant|\d+x\d+|  \S)", 14))],
              "processes of several in-process ranks with NCCL rails, the same-process issue gate on and off "
              "(tools/gpu/host_processes_diag.py)"),
        Stage("handshake", 150, [Step("handshake", [py, "tools/gpu/handshake.py", "--rounds", "100", "--work-us", "0,300"], 150,
                                      show=grep_lines(r"^\|", 12))],
              "what one cross-process handshake costs on a shared GPU, per wait primitive (tools/gpu/handshake.py)"),
        Stage("rsdiag", 150, [Step("rsdiag", [py, "tools/gpu/rsdiag.py"], 150)],
              "where the 70B RS call's time above its byte floor goes (tools/gpu/rsdiag.py)"),
        Stage("rssweep", 200, [Step("rssweep", [py, "tools/gpu/rssweep.py", "/", "/copies_on=copy_engines",
                                                "/copy_ctas=8", "/copy_ctas=16", "/copy_ctas=64", "n_stg=3/", "n_stg=4/",
                                                "sum_ctas=16/", "sum_ctas=16/copy_ctas=16"], 200)],
              "the 70B RS call over plan / executor options, with its copy-kernel overlap (tools/gpu/rssweep.py)"),
        Stage("bench:layout", 200, [bench("bench:layout", "layout", limit=200, png="layout",
                                          show=grep_lines(r"^(#|group|llama|qwen|wan|moe|SUM| +[0-9])", 70),
                                          unset=("CUDA_DEVICE_MAX_CONNECTIONS",))],
              "tide bench layout: one GPU, N virtual ranks"),
        Stage("bench:ag", lim(100, 160), [bench("bench:ag", "ag", "--reps", "10", "--warmup", "2", *topo, limit=lim(100, 160),
                                                png="ag", detail=d_collective)], "tide bench ag (Table 7)"),
        Stage("bench:rs", lim(100, 160), [bench("bench:rs", "rs", "--reps", "10", "--warmup", "2", *topo, limit=lim(100, 160),
                                                png="rs", detail=d_collective)], "tide bench rs (Table 8)"),
        Stage("bench:interference", lim(130, 200), [bench("bench:interference", "interference", "--reps", "20", "--nccl-ctas",
                                                          nccl_ctas, limit=lim(130, 200), png="interference",
                                                          detail=d_interference)], "tide bench interference (Tables 4, 6)"),
        Stage("bench:train", 220, [bench("bench:train", "train", "--timeout", "100", "--steps", "8",
                                         limit=220, png="train", detail=d_train)],
              "tide bench train: step time, memory, loss of the examples"),
        Stage("bench:ceproof", 90, [bench("bench:ceproof", "ag", "--ce-proof", "--spin-s", "2", "--sizes", "8", limit=90,
                                          png="ceproof", detail=d_ceproof)],
              "TIDE-AG's rows reach GPU 1 while a spinner holds GPU 0's SMs (INFO on one GPU)"),
        Stage("bench:hostcall", 480, [Step(f"ranks{n}", [py, "-m", "tide_apps", "bench", "hostcall", "--ranks", str(n), "--iters",
                                                         "30", "--json", js("hostcall", n)], 240, json=js("hostcall", n),
                                           key=True, detail=d_hostcall) for n in (2, 8)],
              "tide bench hostcall: host time per call of tide_torch's CUDA transport beside stock FSDP2's, 2 and 8 ranks"),
    ]
    return {s.name: s for s in stages}


PREBUILT = ("import tide._core as c, tide_xla._ffi as f; assert c.built_with_cuda and c.cuda.available(), "
            "'the carried core has no CUDA here'; print('carried core loads: CUDA', c.cuda.device_count(), "
            "'device(s)')")

GROUPS = {  # a group expands to its stages, in order; NAME:SECONDS entries set limits
    "check": "build smoke kernels bench:layout executor demo sanitize",
    "base": "build smoke",
    "bench": "bench:ag bench:rs bench:interference bench:layout bench:train bench:ceproof",
    "ratio": "build ratio:tiny ratio:small",
    "multi": "build smoke bench:ag bench:rs bench:interference bench:train bench:ceproof torchgpu:150 xlacuda:70 "
             "cudaipc:60 nccl:90",
}


# ---- the runner ----------------------------------------------------------------------------------
def refused(environ) -> list:
    """Why the caller's environment is refused (empty: it is not)."""
    bad = [f"{k}={environ[k]!r} (must be {v} or unset)" for k, v in SAFETY.items() if k in environ and environ[k] != v]
    if MULTICAST_GATE in environ:
        bad.append(f"{MULTICAST_GATE} is set (multicast stays off on the GPU machines)")
    return bad


def child_env(environ) -> dict:
    """The environment of every stage's command: the caller's, the gate unset, SAFETY, DEFAULTS."""
    env = {k: v for k, v in environ.items() if k != MULTICAST_GATE}
    env.update(SAFETY)
    for k, v in DEFAULTS.items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else []))
    return env


def expand(specs, table) -> list:
    """Stage and group names (NAME:SECONDS sets a limit) -> [(stage name, limit or None)], no repeats."""
    out, seen = [], {}

    def add(spec):
        head, _, tail = spec.rpartition(":")
        name, limit = (head, int(tail)) if head and tail.isdigit() else (spec, None)
        if name in GROUPS and limit is None:
            for s in GROUPS[name].split():
                add(s)
        elif name not in table:
            raise SystemExit(f"run.py: unknown stage or group {spec!r} (--list shows them)")
        elif name in seen:
            if limit:
                out[seen[name]] = (name, limit)
        else:
            seen[name] = len(out)
            out.append((name, limit))
    for s in specs:
        add(s)
    return out


def describe(step) -> str:
    env = (["env"] + [x for k in step.unset for x in ("-u", k)]) if step.unset else []
    env += [f"{k}={v}" for k, v in step.env.items()]
    return shlex.join(env + [str(x) for x in step.cmd])


def count_gpus() -> int:
    return sum(ln.startswith("GPU") for ln in probe(["nvidia-smi", "-L"]).splitlines())


class Runner:
    def __init__(self, ctx, table, env, budget):
        self.c, self.table, self.env = ctx, table, env
        self.lock = threading.Lock()
        self.logf = open(ctx.out / "run.log", "w", errors="replace")
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget if budget > 0 else float("inf")
        self.rows, self.status, self.results = [], {}, {}

    def log(self, text):
        with self.lock:
            self.logf.write(text if text.endswith("\n") else text + "\n")
            self.logf.flush()

    def say(self, text):
        print(text, flush=True)
        self.log(text)

    def step(self, stage, step, deadline, lift=0):
        if step.skip:
            self.log(f"---- {stage.name}/{step.name}: SKIP ({step.skip})")
            return "SKIP", step.skip, 0.0
        limit = min(max(step.limit, lift), deadline - time.monotonic())
        if limit < 1:
            return "SKIP", "stage limit spent", 0.0
        env = dict(self.env, **step.env)
        for k in step.unset:
            env.pop(k, None)
        self.log(f"---- {stage.name}/{step.name} (timeout {limit:.0f} s): {describe(step)}")
        if step.json and os.path.exists(step.json):
            os.unlink(step.json)
        t0, tail = time.monotonic(), deque(maxlen=20000)
        try:
            p = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        except OSError as e:
            return "FAIL", f"cannot start: {e}", 0.0
        drop = re.compile(step.drop) if step.drop else None

        def pump():
            for raw in p.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                if not (drop and drop.search(line)):
                    self.log(line)
                    tail.append(line)
        th = threading.Thread(target=pump, daemon=True)
        th.start()
        timed_out = False
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = kill_group(p)
        th.join(5)
        secs = time.monotonic() - t0
        text = "\n".join(tail)
        data = None
        if step.json and os.path.exists(step.json):
            try:
                with open(step.json) as f:
                    data = json.load(f)
                self.results.setdefault(stage.name, {})[step.name] = data
            except (OSError, ValueError) as e:
                self.log(f"run.py: {step.json}: {e}")
        status, detail = judge(step, rc, text, timed_out, data, limit)
        self.log(f"---- {stage.name}/{step.name}: {status} ({secs:.0f} s) {detail}")
        print(f"  {stage.name}/{step.name}: {status} {secs:.0f} s  {detail[:110]}", flush=True)
        if status in ("FAIL", "TIMEOUT"):
            print("\n".join(f"    | {ln}" for ln in list(tail)[-FAIL_TAIL:]), flush=True)
        if step.show:
            print("\n".join(step.show(text)), flush=True)
        if status in ("FAIL", "TIMEOUT") and step.on_fail:
            self.step(stage, step.on_fail, min(max(deadline, time.monotonic() + step.on_fail.limit), self.deadline - 5))
        return status, detail, secs

    def stage(self, stage, limit):
        t0 = time.monotonic()
        why = next((f"needs {n} ({self.status[n]})" for n in stage.needs if self.status.get(n) not in (None, "PASS")),
                   None)
        if self.status.get("build") == "FAIL":
            why = "build failed"
        if self.deadline - t0 < 15:
            why = f"run budget spent (--budget {self.deadline - self.t0:.0f} s)"
        self.say(f"== {stage.name} (limit {limit} s): {stage.doc}")
        if why:
            return self.finish(stage, "SKIP", why, 0.0, [])
        deadline = min(t0 + limit, self.deadline - 5)
        steps, extra = [], ""
        try:
            if stage.pre:
                stage.pre(self.c, self.log)
            for st in stage.steps:
                steps.append((st, *self.step(stage, st, deadline, lift=limit if limit != stage.limit else 0)))
            if stage.post:
                extra = stage.post(self.c, self.log) or ""
        except Exception as e:  # noqa: BLE001 - a broken hook fails its stage, not the run
            steps.append((Step("runner", [], 0), "FAIL", f"{type(e).__name__}: {e}", 0.0))
        counted = [s for s in steps if s[1] != "INFO"]
        states = {s[1] for s in counted}
        status = ("FAIL" if states & {"FAIL", "TIMEOUT"} else "PASS" if "PASS" in states
                  else "INFO" if "INFO" in states or not counted else "SKIP")
        if len(counted) == 1:
            detail = counted[0][2]
        else:
            n = {k: sum(s[1] == k for s in counted) for k in ("PASS", "FAIL", "TIMEOUT", "SKIP", "INFO")}
            bad = next((f"; {s[0].name}: {s[2]}" for s in counted if s[1] in ("FAIL", "TIMEOUT")), "")
            detail = ", ".join(f"{v} {k}" for k, v in n.items() if v) + bad
        return self.finish(stage, status, "; ".join(x for x in (detail, extra) if x), time.monotonic() - t0,
                           steps if len(counted) > 1 else [])

    def finish(self, stage, status, detail, secs, steps):
        self.status[stage.name] = status
        subs = [(s[0].name, s[1], s[3], s[2]) for s in steps if s[0].key or s[1] in ("FAIL", "TIMEOUT")]
        self.rows.append((stage.name, status, secs, detail, subs))
        self.log(f"== {stage.name}: {status} ({secs:.0f} s) {detail}")
        self.dump()

    def dump(self):
        doc = dict(commit=self.c.tree, gpus=self.c.ngpu,
                   stages=[dict(name=n, status=s, seconds=round(t, 1), detail=d,
                                steps=[dict(name=a, status=b, seconds=round(c, 1), detail=e) for a, b, c, e in subs])
                           for n, s, t, d, subs in self.rows], results=self.results)
        with open(self.c.out / "results.json", "w") as f:
            json.dump(doc, f, indent=1, default=str)

    def summary(self):
        files = [p for p in self.c.out.rglob("*") if p.is_file()]
        self.say(f"\n================ tools/gpu/run.py summary ({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, "
                 f"{time.monotonic() - self.t0:.0f} s, {self.c.ngpu} GPU(s)) ================")
        for name, status, secs, detail, subs in self.rows:
            self.say(f"{name:20} {status:7} {secs:5.0f} s  {detail[:150]}")
            for a, b, c, e in subs:
                self.say(f"  {a:18} {b:7} {c:5.0f} s  {e[:150]}")
        self.say(f"logs in {self.c.out}: " + ", ".join(sorted(p.name for p in files))
                 + (f"; WARNING: {len(files)} files, 8 come back from the GPU machine" if len(files) > 8 else ""))


def kill_group(p) -> int:
    """SIGTERM to the command's process group, SIGKILL KILL_GRACE_S later (as `timeout -k`)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=wait)
            if sig == signal.SIGTERM:
                os.killpg(p.pid, signal.SIGKILL)  # stragglers of the group
                break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    return p.wait()


def judge(step, rc, text, timed_out, data, limit):
    last = last_line(text)
    if timed_out:
        return "TIMEOUT", f"killed at {limit:.0f} s; last line: {last}"
    if step.kind == "info":
        return "INFO", last
    status, detail = ("PASS", last) if rc == 0 else ("FAIL", f"rc {rc}: {last}")
    if step.kind == "pytest" and rc == 0 and "passed" not in last:
        status, detail = ("SKIP" if step.may_skip and "skipped" in last else "FAIL"), f"nothing ran: {last}"
    if status == "PASS" and step.json and data is None:
        return "FAIL", f"no JSON written; {last}"
    if status == "PASS" and step.detail:
        try:
            got = step.detail(text, data)
        except Exception as e:  # noqa: BLE001 - a JSON without the expected fields
            return "FAIL", f"unexpected output ({type(e).__name__}: {e})"
        status, detail = got if isinstance(got, tuple) else (status, got or last)
    return status, detail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", nargs="*", help="stages and groups, NAME or NAME:SECONDS (default: check; --multi: multi)")
    ap.add_argument("--list", action="store_true", help="print the stage table and the groups")
    ap.add_argument("--dry-run", action="store_true", help="print each stage's commands and environment, run nothing")
    ap.add_argument("--multi", action="store_true", help="the multi-GPU runs (needs >= 2 GPUs)")
    ap.add_argument("--allow-one-gpu", action="store_true", help="--multi on one GPU: its one-GPU subsets run")
    ap.add_argument("--gpus", type=int, default=None, help="with --dry-run/--list: pretend this many GPUs")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_out", help="logs and JSON ($OUT, default ./gpu_out)")
    ap.add_argument("--budget", type=int, default=BUDGET_S, help="seconds for the whole run, 0: none (default %(default)s)")
    ap.add_argument("--plots", action="store_true", help="benches also write PNGs to $OUT (mind the 8 files)")
    ap.add_argument("--args", action="append", default=[], metavar="STAGE=ARGS",
                    help="append shell-split ARGS to the stage's commands, e.g. 'suite=-k reduce'")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the stages (default: this one)")
    ap.add_argument("--tree", default=None, metavar="COMMIT",
                    help="the commit the copied tree is (git HEAD here may be older: the device copies a "
                         "working tree, not its history); printed in the header and results.json")
    a = ap.parse_args(argv)
    bad = refused(os.environ)
    if bad:
        print("run.py: refusing to start: " + "; ".join(bad), file=sys.stderr)
        return 2
    if a.gpus is not None and not (a.dry_run or a.list):
        ap.error("--gpus only with --dry-run or --list")
    out = Path(a.out).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="tide_gpu_run_"))
    try:
        ngpu = a.gpus if a.gpus is not None else count_gpus()
        head = probe(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "?"
        tree = a.tree or f"git HEAD {head} (a copied tree may be newer: pass --tree)"
        ctx = Ctx(out=out, tmp=tmp, py=a.python, ngpu=ngpu, multi=a.multi, plots=a.plots, tree=tree)
        table = stage_table(ctx)
        if a.list:
            for s in table.values():
                print(f"{s.name:20} {s.limit:4d} s  {s.doc}")
            print("\ngroups:\n" + "\n".join(f"  {g:8} {v}" for g, v in GROUPS.items()))
            return 0
        plan = expand(a.stages or ["multi" if a.multi else "check"], table)
        for spec in a.args:
            name, _, rest = spec.partition("=")
            if name not in table:
                ap.error(f"--args {spec!r}: no stage {name!r}")
            for st in table[name].steps:
                if st.kind != "info" and st.cmd:
                    st.cmd += shlex.split(rest)
        if a.multi and ngpu < 2 and not (a.dry_run or a.allow_one_gpu):
            print(f"run.py: --multi: {ngpu} GPU(s) visible; needs >= 2 (--allow-one-gpu runs the one-GPU subsets, "
                  "--dry-run prints them)", file=sys.stderr)
            return 2
        env = child_env(os.environ)
        if a.dry_run:
            return dry_run(ctx, table, plan, env)
        out.mkdir(parents=True, exist_ok=True)
        r = Runner(ctx, table, env, a.budget)
        r.say(f"== tools/gpu/run.py {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, tree "
              f"{ctx.tree}, {ngpu} GPU(s), stages: "
              + " ".join(f"{n}:{lim or table[n].limit}" for n, lim in plan))
        for ln in probe(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
                         "--format=csv,noheader"]).splitlines():
            r.say(ln)
        r.say("env: " + " ".join(f"{k}={env[k]}" for k in (*SAFETY, *DEFAULTS)) + f"; {MULTICAST_GATE} unset")
        for name, lim in plan:
            r.stage(table[name], lim or table[name].limit)
        r.summary()
        return 1 if any(row[1] == "FAIL" for row in r.rows) else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dry_run(ctx, table, plan, env) -> int:
    print("# every command runs in " + str(ROOT) + " with: " + " ".join(f"{k}={env[k]}" for k in
          (*SAFETY, *DEFAULTS, "PYTHONPATH")) + f"; {MULTICAST_GATE} unset; logs to {ctx.out}")
    for name, lim in plan:
        s = table[name]
        print(f"== {name} (limit {lim or s.limit} s{', needs ' + ', '.join(s.needs) if s.needs else ''}): {s.doc}")
        if s.pre is build_pre:
            so6 = link_flags()[1]
            print("   before: rm -rf build/inplace; " + (f"link {so6} as build/linkfix/libstdc++.so" if so6 else
                                                          "libstdc++.so dev symlink present"))
        for st in s.steps + [x.on_fail for x in s.steps if x.on_fail]:
            head = f"   {st.name} [{st.kind}, timeout {st.limit} s]"
            print(f"{head}: SKIP ({st.skip})" if st.skip else f"{head}: {describe(st)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
