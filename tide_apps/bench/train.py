"""`tide bench train`: the same Llama-style model trained five ways, side by side.

Runs the two examples as subprocesses with the same model and data arguments (--size, --steps,
--warmup, --seed, --batch, --seq; tide_apps/llama_spec.py gives both the same initial weights,
tokens and AdamW) and tabulates what each writes with `--json PATH`:
  examples/fsdp2_llama.py  stock (FSDP2), tide_in_place and tide_slot_reuse
  examples/flax_fsdp.py    gspmd (XLA's own sharding) and tide_xla
JSON schema of an example: {"framework": "torch"|"jax", "device": str, "world": int,
  "model": {size fields, "size", "seed", "global_batch", "parameters"} (optional),
  "runs": [{"name": str, "step_ms": float, "peak_bytes": int|null, "final_loss": float,
            "losses": [float], "layout_copies": {op: {"calls": int, "bytes": int|null}}|null,
            "copies_source": str (optional)}]}
Columns: step time and peak memory against the framework's baseline (stock, gspmd: baseline /
run, so > 1 means faster or smaller); the first and last loss; max |loss - baseline's| over the
steps; the step-1 loss against torch's stock run (relative: the frameworks' kernels differ, the
weights and tokens do not); the layout copies a path removed per step (baseline's bytes minus
the path's, rank 0; "n/a" where the baseline's are not counted, e.g. XLA's own). A table of the
loss per step and each path's copies follow.
Launch: CPU: torch on --world gloo ranks, jax on as many XLA:CPU host devices (one process
each); GPUs: torchrun over every GPU (one GPU: world 1), jax on every GPU of one process (one
GPU: a 1 x 1 topology), each jax run in its own process (--separate: its own peak memory).
--shared-gpu N [--nodes M]: both frameworks as N processes on GPU 0, each an emulated host
(torch: the example's own spawn, jax: N jax.distributed processes), TIDE's topology M x N/M;
NCCL's loopback sockets carry the traffic, so step times show overheads, not bandwidth.
`--torch-args` / `--jax-args` append arguments to one example (they win over the shared ones).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from tide_apps.bench import common
from tide_apps.bench.common import progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE = {"torch": "stock", "jax": "gspmd"}
CPU_WORLD = 4


def _presets() -> dict:
    """The examples' size presets (tide_apps.llama_spec.SIZES, numpy only)."""
    from tide_apps import llama_spec
    return llama_spec.SIZES


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


def model_args(args) -> list[str]:
    """The arguments both examples get: the same model, weights, tokens, steps and warm-up."""
    out = ["--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--seed", str(args.seed)]
    for k in ("batch", "seq"):
        if getattr(args, k) is not None:
            out += [f"--{k}", str(getattr(args, k))]
    return out


def _launch(framework, ctx, py, script, json_path, shared, extra, world, shared_gpu=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if ctx.kind != "cpu" and shared_gpu:  # N processes on GPU 0, one emulated host each
        n, m = shared_gpu
        where = f"1 GPU shared by {n} processes (emulated hosts, topology {m}x{n // m})"
        if framework == "torch":
            cmd = [py, script, "--device", "cuda", "--world", str(n), "--shared-gpu", "--nodes", str(m)]
        else:
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            cmd = [py, script, "--processes", str(n), "--shared-gpu", "--nodes", str(m), "--separate"]
        return cmd + shared + ["--json", json_path] + shlex.split(extra or ""), env, where
    if framework == "torch":
        if ctx.kind == "cpu":
            cmd, where = [py, script, "--device", "cpu", "--world", str(world)], f"CPU, {world} gloo ranks"
        else:
            n = ctx.gpus
            cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script,
                   "--device", "cuda"]
            where = f"{n} GPU(s), NCCL"
            if n == 1:  # enable() keeps stock FSDP2 at world 1 by default: the bench compares TIDE's path
                cmd.append("--serve-single-rank")
                where += ", TIDE served at world 1 (--serve-single-rank)"
    else:
        cmd = [py, script]
        if ctx.gpus < 1:
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={world}")
            where = f"XLA:CPU, {world} host devices"
        else:
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            cmd.append("--separate")  # one process per run: each run's peak_bytes is its own
            where = f"{ctx.gpus} GPU(s)"
    return cmd + shared + ["--json", json_path] + shlex.split(extra or ""), env, where


def run_example(framework, ctx, py, script, shared, extra, timeout, world=CPU_WORLD, shared_gpu=None) -> dict:
    """One example's JSON (validated), or {"framework", "error"}. shared_gpu: (processes, nodes)."""
    with tempfile.TemporaryDirectory(prefix="tide_bench_train_") as d:
        path = os.path.join(d, f"{framework}.json")
        cmd, env, where = _launch(framework, ctx, py, script, path, shared, extra, world, shared_gpu)
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
    if obj.get("model") is not None and not isinstance(obj["model"], dict):
        raise ValueError("field 'model' is not an object")
    for i, r in enumerate(obj["runs"]):
        for k, typ in (("name", str), ("step_ms", (int, float)), ("final_loss", (int, float)), ("losses", list)):
            if not isinstance(r.get(k), typ):
                raise ValueError(f"runs[{i}].{k} missing or of the wrong type")
        if not r["losses"] or not all(isinstance(v, (int, float)) for v in r["losses"]):
            raise ValueError(f"runs[{i}].losses is empty or not numbers")
        if r.get("peak_bytes") is not None and not isinstance(r["peak_bytes"], int):
            raise ValueError(f"runs[{i}].peak_bytes is not an int or null")
        copies = r.get("layout_copies")
        if copies is not None:
            if not isinstance(copies, dict):
                raise ValueError(f"runs[{i}].layout_copies is not an object or null")
            for op, c in copies.items():
                if not (isinstance(c, dict) and isinstance(c.get("calls"), int)
                        and (c.get("bytes") is None or isinstance(c["bytes"], int))):
                    raise ValueError(f"runs[{i}].layout_copies[{op!r}] is not {{calls: int, bytes: int|null}}")


def _copy_bytes(run) -> int | None:
    """Bytes of a run's layout copies per step, or None where not counted."""
    c = run.get("layout_copies")
    if c is None or any(v.get("bytes") is None for v in c.values()):
        return None
    return sum(v["bytes"] for v in c.values())


def tabulate(results) -> list[dict]:
    rows = []
    ref = next((r for res in results if "error" not in res for r in res["runs"]
                if r["name"] == BASELINE["torch"] and res["framework"] == "torch"), None)
    for res in results:
        fw = res["framework"]
        if "error" in res:
            rows.append(dict(framework=fw, where=res.get("where"), note=res["error"]))
            continue
        base = next((r for r in res["runs"] if r["name"] == BASELINE.get(fw)), None)
        for r in res["runs"]:
            row = dict(framework=fw, where=res["where"], world=res["world"], run=r["name"], step_ms=r["step_ms"],
                       peak_bytes=r.get("peak_bytes"), first_loss=r["losses"][0], final_loss=r["final_loss"],
                       steps=len(r["losses"]), copy_bytes=_copy_bytes(r))
            if ref is not None and ref["losses"][0]:
                row["x_rel1"] = (r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
            if base:
                row["speedup"] = common.ratio(base["step_ms"], r["step_ms"])
                row["mem_ratio"] = common.ratio(base.get("peak_bytes"), r.get("peak_bytes"))
                row["loss_diff"] = r["final_loss"] - base["final_loss"]
                row["max_dloss"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
                b_bytes = _copy_bytes(base)
                if r is base:
                    row["copies"] = "baseline"
                elif b_bytes is not None and row["copy_bytes"] is not None:
                    row["copies_removed"] = b_bytes - row["copy_bytes"]
                    row["copies"] = common.fmt_bytes(row["copies_removed"])
                elif row["copy_bytes"] is not None:
                    row["copies"] = f"n/a; own {common.fmt_bytes(row['copy_bytes'])}"
            row.setdefault("copies", "not counted" if r.get("layout_copies") is None else "-")
            rows.append(row)
    return rows


def same_model(results) -> tuple[bool | None, str]:
    """Whether every framework's example reports the same "model" (shapes, seed, global batch)."""
    models = {res["framework"]: res.get("model") for res in results if "error" not in res}
    if len(models) < 2:
        return None, "one framework ran"
    if any(m is None for m in models.values()):
        return None, "an example does not report its model"
    (a, ma), (b, mb) = list(models.items())[:2]
    keys = sorted(set(ma) | set(mb))
    diff = [k for k in keys if k != "batch" and ma.get(k) != mb.get(k)]
    if diff:
        return False, f"{a} and {b} differ in " + ", ".join(f"{k} ({ma.get(k)} vs {mb.get(k)})" for k in diff)
    return True, (f"{ma.get('size')} ({ma.get('parameters'):,} parameters), global batch "
                  f"{ma.get('global_batch')} x {ma.get('seq')} tokens, seed {ma.get('seed')}")


def print_details(results, out=None) -> None:
    """The loss of every path per step, then each path's layout copies (what they count)."""
    out = out or sys.stdout
    paths = [(f"{res['framework']}/{r['name']}", r) for res in results if "error" not in res for r in res["runs"]]
    if not paths:
        return
    w = max(12, *(len(n) for n, _ in paths))
    print("\nloss per step\n" + f"{'step':>4} " + " ".join(f"{n:>{w}}" for n, _ in paths), file=out)
    for i in range(max(len(r["losses"]) for _, r in paths)):
        print(f"{i + 1:4d} " + " ".join(f"{r['losses'][i]:{w}.6f}" if i < len(r["losses"]) else f"{'-':>{w}}"
                                        for _, r in paths), file=out)
    print("\nlayout copies per step", file=out)
    for name, r in paths:
        c = r.get("layout_copies")
        ops = "not counted" if c is None else ", ".join(
            f"{op} {v['calls']} ({common.fmt_bytes(v['bytes']) if v['bytes'] is not None else '? B'})"
            for op, v in c.items())
        print(f"  {name:{w}s} {ops}" + (f"  [{r['copies_source']}]" if r.get("copies_source") else ""), file=out)


def print_breakdowns(results, out=None) -> None:
    """--trace: per rank, each run's breakdown of its traced step beside the baseline's."""
    from tide_apps.bench import timeline
    for res in results:
        runs = [r for r in res.get("runs", []) if r.get("breakdowns")]
        if not runs:
            continue
        print(f"\nwhere the traced step's milliseconds go ({res['framework']}, ms; the last column: "
              "last run minus first)", file=out or sys.stdout)
        for rank in range(max(len(r["breakdowns"]) for r in runs)):
            cols = {r["name"]: r["breakdowns"][rank] for r in runs
                    if rank < len(r["breakdowns"]) and r["breakdowns"][rank]}
            print(f"  rank {rank}", file=out or sys.stdout)
            for line in timeline.table(cols):
                print("    " + line, file=out or sys.stdout)


def plot(path, title, results) -> None:
    """Loss per step (one line per path) and median step time (one bar per path)."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    paths = [(f"{res['framework']}/{r['name']}", r) for res in results if "error" not in res for r in res["runs"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in paths:
        a1.plot(range(1, len(r["losses"]) + 1), r["losses"], marker=".", label=name)
    a1.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    a1.set_xlabel("step")
    a1.set_ylabel("loss (mean over the global batch)")
    a2.bar(range(len(paths)), [r["step_ms"] for _, r in paths],
           color=[f"C{i}" for i in range(len(paths))])
    a2.set_xticks(range(len(paths)))
    a2.set_xticklabels([n for n, _ in paths], rotation=30, ha="right", fontsize=8)
    a2.set_ylabel("ms per step (median)")
    if paths:
        a1.legend(fontsize=7)
    else:
        a1.text(0.5, 0.5, "no runs (see the table's notes)", ha="center", va="center", transform=a1.transAxes)
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tide bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)  # here --warmup is steps left out of the median (default 3)
    sizes = _presets()
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--size", default="tiny", **({"choices": tuple(sizes)} if sizes else {}),
                    help="the examples' model preset")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank / device (preset's)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (preset's)")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and tokens")
    ap.add_argument("--world", type=int, default=None,
                    help=f"CPU: torch gloo ranks and XLA:CPU host devices (default {CPU_WORLD}); on GPUs "
                         "the world is every GPU")
    ap.add_argument("--shared-gpu", type=int, default=0, metavar="N",
                    help="GPU: run both frameworks as N processes sharing GPU 0, each an emulated host (its own "
                         "NCCL_HOSTID, NCCL over loopback sockets): correctness and overheads, not bandwidth")
    ap.add_argument("--nodes", type=int, default=0,
                    help="with --shared-gpu: TIDE's topology nodes (default: one per process)")
    ap.add_argument("--torch-example", default=os.path.join(ROOT, "examples", "fsdp2_llama.py"))
    ap.add_argument("--jax-example", default=os.path.join(ROOT, "examples", "flax_fsdp.py"))
    ap.add_argument("--torch-args", default="", help="extra arguments for the torch example")
    ap.add_argument("--jax-args", default="", help="extra arguments for the jax example")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per example")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="torch: profile the last step of every variant on every rank (CPU and CUDA "
                         "activities) into DIR/<variant>.rank<r>.json and print where each "
                         "millisecond goes, stock beside TIDE (tide_apps/bench/timeline.py)")
    args = ap.parse_args(argv)
    args.warmup = args.warmup or min(3, args.steps - 1)
    for k in ("steps", "batch", "seq", "world"):
        v = getattr(args, k)
        if v is not None and v < 1:
            ap.error(f"--{k} must be >= 1, got {v}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in frameworks if f not in BASELINE]
    if bad or not frameworks:
        ap.error(f"--frameworks: unknown framework(s) {bad} (torch, jax)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib (pip install matplotlib)")
    try:
        ctx = common.detect_context(args.context)
    except ValueError as ex:
        print(f"tide bench train: error: {ex}", file=sys.stderr)
        return 2
    if args.world is not None and ctx.kind != "cpu":
        ap.error(f"--world: only with --context cpu; on GPUs the world is every GPU ({ctx.gpus})")
    shared_gpu = None
    if args.shared_gpu or args.nodes:
        if ctx.kind == "cpu" or args.shared_gpu < 2:
            ap.error("--shared-gpu N (N >= 2) and --nodes: on a GPU (--context gpu)")
        nodes = args.nodes or args.shared_gpu
        if args.shared_gpu % nodes:
            ap.error(f"--nodes {nodes} does not divide --shared-gpu {args.shared_gpu}")
        shared_gpu = (args.shared_gpu, nodes)
    world = args.world or CPU_WORLD
    print(f"# tide bench train: {ctx.label.split(':')[0]}")
    shared = model_args(args)
    results = []
    for fw in frameworks:
        script = args.torch_example if fw == "torch" else args.jax_example
        extra = args.torch_args if fw == "torch" else args.jax_args
        if fw == "torch" and args.trace:
            extra = f"--trace {shlex.quote(os.path.abspath(args.trace))} {extra}"
        results.append(run_example(fw, ctx, sys.executable, script, shared, extra, args.timeout, world, shared_gpu))
    rows = tabulate(results)
    same, why = same_model(results)
    print(f"model: {' '.join(shared)}; same model, weights and tokens in every framework: "
          f"{ {True: 'yes', False: 'NO', None: 'not checked'}[same]} ({why})")
    pct = lambda v: f"{v:.2f}x"  # noqa: E731
    common.print_table(rows, [("framework", "fw", 5, str), ("run", "run", 16, str), ("where", "where", 22, str),
                              ("step_ms", "step ms", 9, ".1f"), ("speedup", "vs base", 7, pct),
                              ("peak_bytes", "peak mem", 10, common.fmt_bytes), ("mem_ratio", "mem vs", 6, pct),
                              ("first_loss", "loss@1", 8, ".4f"), ("final_loss", "loss@end", 8, ".4f"),
                              ("max_dloss", "max|dl|base", 11, ".2e"), ("x_rel1", "@1 vs torch", 11, "+.1e"),
                              ("copies", "copies removed", 18, str), ("note", "note", 1, str)])
    if any(r.get("peak_bytes") is None and "note" not in r for r in rows):
        print("peak mem '-': not known on this device (CPU: torch reports the process RSS, not a per-run peak; "
              "XLA:CPU has no allocator statistics)")
    print_details(results)
    print_breakdowns(results)
    result = dict(bench="train", context=ctx.kind, label=ctx.label, model_args=shared, same_model=same,
                  results=results, rows=rows)
    common.write_json(args.json, result)
    if args.plot:
        plot(args.plot, f"tide bench train: {' '.join(shared)} ({ctx.label.split(':')[0]})", results)
    return 0 if all("error" not in r for r in results) and same is not False else 1


if __name__ == "__main__":
    sys.exit(main())
