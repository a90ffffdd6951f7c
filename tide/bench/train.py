"""`tide bench train`: step time, peak memory and loss of the same model trained different ways.

Runs the two examples as subprocesses, each with `--json PATH`, and tabulates what they write:
  examples/fsdp2_llama.py  runs stock (FSDP2), tide_in_place and tide_slot_reuse
  examples/flax_fsdp.py    runs gspmd (XLA's own sharding) and tide_xla
JSON schema of an example: {"framework": "torch"|"jax", "device": str, "world": int,
  "runs": [{"name": str, "step_ms": float, "peak_bytes": int|null, "final_loss": float,
            "losses": [float]}]}
Ratios: step time and peak memory of each run against the framework's baseline (stock, gspmd:
baseline / run, so > 1 means faster or smaller) and the final-loss difference.
Launch: CPU: the examples' CPU defaults (jax on 8 XLA:CPU host devices); GPUs: torchrun over every
GPU (one GPU: world 1), jax on every GPU of one process (one GPU: a 1 x 1 topology).
`--torch-args` / `--jax-args` append arguments (e.g. tiny model sizes).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from tide.bench import common
from tide.bench.common import progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE = {"torch": "stock", "jax": "gspmd"}


def _supports_json(py, script, env, timeout) -> tuple[bool, str]:
    try:
        r = subprocess.run([py, script, "--help"], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"`{os.path.basename(script)} --help` timed out"
    if r.returncode != 0:
        return False, f"`{os.path.basename(script)} --help` failed: {(r.stderr or r.stdout).strip()[-200:]}"
    if "--json" not in r.stdout:
        return False, f"{os.path.relpath(script, ROOT)} has no --json option (older checkout)"
    return True, ""


def _launch(framework, ctx, py, script, json_path, extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if framework == "torch":
        if ctx.kind == "cpu":
            cmd, where = [py, script, "--device", "cpu"], "CPU (gloo ranks)"
        else:
            n = ctx.gpus
            cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script,
                   "--device", "cuda"]
            where = f"{n} GPU(s), NCCL"
    else:
        cmd = [py, script]
        if ctx.gpus < 1:
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
            where = "XLA:CPU, 8 host devices"
        else:
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            cmd.append("--separate")  # one process per run: each run's peak_bytes is its own
            where = f"{ctx.gpus} GPU(s)"
    return cmd + ["--json", json_path] + shlex.split(extra or ""), env, where


def run_example(framework, ctx, py, script, extra, timeout) -> dict:
    """One example's JSON (validated), or {"framework", "error"}."""
    with tempfile.TemporaryDirectory(prefix="tide_bench_train_") as d:
        path = os.path.join(d, f"{framework}.json")
        cmd, env, where = _launch(framework, ctx, py, script, path, extra)
        ok, why = _supports_json(py, script, env, min(timeout, 120))
        if not ok:
            return dict(framework=framework, where=where, error=f"not available: {why}")
        progress(f"train: {' '.join(cmd)}")
        t = time.time()
        tail = []
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
            for line in p.stdout:
                tail = (tail + [line.rstrip()])[-20:]
                print(f"  [{framework}] {line.rstrip()}", file=sys.stderr, flush=True)
                if time.time() - t > timeout:
                    p.kill()
                    break
            rc = p.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired) as ex:
            return dict(framework=framework, where=where, error=f"failed: {ex}")
        if rc != 0:
            return dict(framework=framework, where=where,
                        error=f"failed: exit {rc} after {time.time() - t:.0f} s: {' | '.join(tail[-3:])[-300:]}")
        try:
            with open(path) as f:
                obj = json.load(f)
            validate(obj)
        except (OSError, ValueError) as ex:
            return dict(framework=framework, where=where, error=f"bad --json output: {ex}")
        obj["where"], obj["seconds"] = where, time.time() - t
        return obj


def validate(obj) -> None:
    """Raises ValueError naming the field when an example's JSON does not follow the schema."""
    if not isinstance(obj, dict):
        raise ValueError("top level is not an object")
    for k, typ in (("framework", str), ("device", str), ("world", int), ("runs", list)):
        if not isinstance(obj.get(k), typ):
            raise ValueError(f"field {k!r} missing or not {typ.__name__}")
    for i, r in enumerate(obj["runs"]):
        for k, typ in (("name", str), ("step_ms", (int, float)), ("final_loss", (int, float)), ("losses", list)):
            if not isinstance(r.get(k), typ):
                raise ValueError(f"runs[{i}].{k} missing or of the wrong type")
        if r.get("peak_bytes") is not None and not isinstance(r["peak_bytes"], int):
            raise ValueError(f"runs[{i}].peak_bytes is not an int or null")


def tabulate(results) -> list[dict]:
    rows = []
    for res in results:
        fw = res["framework"]
        if "error" in res:
            rows.append(dict(framework=fw, where=res.get("where"), note=res["error"]))
            continue
        base = next((r for r in res["runs"] if r["name"] == BASELINE.get(fw)), None)
        for r in res["runs"]:
            row = dict(framework=fw, where=res["where"], world=res["world"], run=r["name"], step_ms=r["step_ms"],
                       peak_bytes=r.get("peak_bytes"), final_loss=r["final_loss"], steps=len(r["losses"]))
            if base:
                row["speedup"] = common.ratio(base["step_ms"], r["step_ms"])
                row["mem_ratio"] = common.ratio(base.get("peak_bytes"), r.get("peak_bytes"))
                row["loss_diff"] = r["final_loss"] - base["final_loss"]
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tide bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--torch-example", default=os.path.join(ROOT, "examples", "fsdp2_llama.py"))
    ap.add_argument("--jax-example", default=os.path.join(ROOT, "examples", "flax_fsdp.py"))
    ap.add_argument("--torch-args", default="", help="extra arguments for the torch example")
    ap.add_argument("--jax-args", default="", help="extra arguments for the jax example")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per example")
    args = ap.parse_args(argv)
    try:
        ctx = common.detect_context(args.context)
    except ValueError as ex:
        print(f"tide bench train: error: {ex}", file=sys.stderr)
        return 2
    print(f"# tide bench train: {ctx.label.split(':')[0]}")
    results = []
    for fw in [f.strip() for f in args.frameworks.split(",") if f.strip()]:
        if fw not in BASELINE:
            print(f"tide bench train: error: --frameworks: unknown framework {fw!r} (torch, jax)", file=sys.stderr)
            return 2
        script = args.torch_example if fw == "torch" else args.jax_example
        extra = args.torch_args if fw == "torch" else args.jax_args
        results.append(run_example(fw, ctx, sys.executable, script, extra, args.timeout))
    rows = tabulate(results)
    pct = lambda v: f"{v:.2f}x"  # noqa: E731
    common.print_table(rows, [("framework", "fw", 5, str), ("run", "run", 16, str), ("where", "where", 24, str),
                              ("step_ms", "step ms", 9, ".1f"), ("speedup", "vs base", 7, pct),
                              ("peak_bytes", "peak mem", 11, common.fmt_bytes), ("mem_ratio", "mem vs", 7, pct),
                              ("final_loss", "final loss", 10, ".4f"), ("loss_diff", "loss diff", 10, "+.2e"),
                              ("note", "note", 1, str)])
    result = dict(bench="train", context=ctx.kind, label=ctx.label, results=results, rows=rows)
    common.write_json(args.json, result)
    if args.plot:
        groups = {}
        for r in rows:
            if "step_ms" in r:
                groups.setdefault(r["framework"], {})[r["run"]] = r["step_ms"]
        common.bar_plot(args.plot, f"tide bench train: step time ({ctx.label[:60]})", groups, "ms per step")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
