"""`tide plan`: the planner's command line (framework-free, like all of `tide`).

`python -m tide plan ...` runs it alone; the `tide` command (the console script, from the
applications package above the faces) adds `tide demo` and `tide bench ...` to it through
add_plan_command. Nothing here imports a framework, a face or that package."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tide.report import (TABLE_NODES, format_memory_table, format_plan, memory_by_topology,
                         plan_dict)


def _add_plan_args(ap: argparse.ArgumentParser) -> None:
    src = ap.add_argument_group("group (one of)")
    src.add_argument("--model", help="built-in model: llama3.1-70b, qwen3-30b-a3b, wan2.2-14b")
    src.add_argument("--group", default="block",
                     help="group of --model: block, largest, or a model-specific one "
                          "(embedding, head, root, block_per_expert)")
    src.add_argument("--shapes", metavar="FILE.json",
                     help="JSON list of shapes, or {name: shape}")
    ap.add_argument("--nodes", type=int, default=8, help="M (default 8)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="L <= 8 (default 8)")
    ap.add_argument("--mode", default="in_place", help="in_place (default) or slot_reuse")
    ap.add_argument("--w-wave", type=int, default=0, help="W_wave (default L)")
    ap.add_argument("--k", type=int, default=0, help="rail transfers per round (default: solver)")
    ap.add_argument("--n-part", type=int, default=0, help="sub-slice passes (default: planner)")
    ap.add_argument("--n-stg", type=int, default=2, help="local staging slots (default 2)")
    ap.add_argument("--chunk-bytes", type=int, default=0, help="RS staging chunk (default: planner)")
    ap.add_argument("--sum-ctas", type=int, default=0, help="C_sum (default: solver)")
    ap.add_argument("--land-ctas", type=int, default=0, help="C_mc (default: solver)")
    ap.add_argument("--dtype", default="bfloat16",
                    help="AG and gradient dtype: bfloat16 (default), float16, float32, or a "
                         "1-byte item: uint8, float8_e4m3fn, float8_e5m2")
    ap.add_argument("--grad-dtype", help="gradient dtype (default --dtype; bfloat16 for "
                    "a 1-byte --dtype: uint8, float8_e4m3fn, float8_e5m2)")
    ap.add_argument("--shard-dtype", help="sharded (master) dtype; differs from --dtype = cast")
    ap.add_argument("--shard-dim", action="append", default=[], metavar="NAME=K",
                    help="parameter NAME (of a --shapes {name: shape} file, or its index) is "
                    "sharded on dim K > 0 (FSDP2's Shard(K)): planned as its rows (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--validate-all", action="store_true",
                    help="validate every base plan up to --max-nodes at --gpus-per-node")
    ap.add_argument("--max-nodes", type=int, default=1024, help="for --validate-all")


# The most a --shapes file may hold: a group has at most 256 parameters (tide::kMaxParams), whose
# shapes take a few KiB; a {name: shape} file of a whole model's names stays far below this. A
# larger input (/dev/zero, a wrong file) is refused after reading this many bytes, never all of it.
SHAPES_MAX_BYTES = 4 << 20


def _read_shapes(path: str, max_bytes: int = SHAPES_MAX_BYTES):
    """The --shapes file's JSON; every failure is a ValueError naming --shapes and the file.
    At most ``max_bytes`` (+1) bytes are read, whatever the file is (a device, a pipe), and
    nothing waits for a writer."""
    try:
        # Opened without blocking (a FIFO nobody writes to would block open() for ever), then
        # read blocking: a FIFO without a writer reads as empty, a device (/dev/zero) as bytes.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        with open(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"--shapes {path}: cannot read it: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise ValueError(f"--shapes {path}: more than {max_bytes >> 20} MiB (a group's shapes "
                         f"take a few KiB: at most 256 parameters); not a shapes file?")
    try:
        return json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--shapes {path}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno}; truncated?)") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--shapes {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"--shapes {path}: nested too deeply (expected a list of shapes, each "
                         "a list of ints, or {name: shape})") from None


def _signature(args: argparse.Namespace):
    from tide import models
    from tide.plan import GroupSignature

    # 1-byte AG items (uint8, FP8 data) are all-gather only: their gradients default to bfloat16.
    byte_item = args.dtype in ("uint8", "float8_e4m3fn", "float8_e5m2")
    dt = dict(ag_dtype=args.dtype, grad_dtype=args.grad_dtype or ("bfloat16" if byte_item else args.dtype),
              shard_dtype=args.shard_dtype)
    if (args.model is None) == (args.shapes is None):
        raise ValueError("give exactly one of --model or --shapes")
    if args.shapes:
        return f"{args.shapes}", GroupSignature.from_json(_read_shapes(args.shapes), **dt)
    group = args.group
    title = f"{args.model} / {group}"
    if group == "largest":
        title += f" ({models.largest_group_name(args.model)})"
    return title, models.signature(args.model, group, **dt)


def _shard_dims(sig, specs: list[str], world: int):
    """--shard-dim NAME=K: ``sig`` with each such parameter as its rows (tide/plan.py
    [Note: Shard(k) as rows]), and one line per parameter saying where its columns land."""
    from tide.plan import GroupSignature, shard_rows
    if not specs:
        return sig, {}
    names = [str(n) for n in sig.names] or [str(i) for i in range(len(sig.shapes))]
    dims = {}
    for spec in specs:
        name, _, k = spec.rpartition("=")
        if name not in names or not k.lstrip("-").isdigit():
            raise ValueError(f"--shard-dim {spec}: expected NAME=K with NAME one of {names}")
        dims[names.index(name)] = int(k)
    shapes, out_names, where = [], [], {}
    for p, shape in enumerate(sig.shapes):
        if p not in dims:
            shapes.append(shape)
            out_names.append(names[p])
            continue
        rows, item = shard_rows(shape, dims[p], world)
        where[p] = (len(shapes), rows, item, dims[p])
        shapes += [item] * rows
        out_names += [f"{names[p]}[{a}]" for a in range(rows)]
    return GroupSignature(shapes=shapes, ag_dtype=sig.ag_dtype, grad_dtype=sig.grad_dtype,
                          shard_dtype=sig.shard_dtype, names=tuple(out_names)), where


def _shard_dim_lines(p, sig, where) -> list[str]:
    lines = []
    for q, (first, rows, item, dim) in where.items():
        pl = p.layout.params[first]
        N = p.layout.N
        lines.append(f"Shard({dim}) {sig.names[q] if sig.names else q} {tuple(sig.shapes[q])}: "
                     f"{rows} rows = params {first}..{first + rows - 1} of ({N}, {item[1]}); rank r's "
                     f"columns of row a land at {p.layout.landing(first, 0)} + a*{N * pl.s} + r*{pl.s} "
                     f"(a 2-D block: {rows} rows of {pl.s} B, pitch {N * pl.s} B)")
    return lines


def _ranges(values: list[int]) -> str:
    """[2, 3, 4, 9, 17, 18] -> '2-4, 9, 17-18'."""
    out, vs = [], sorted(values)
    i = 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        out.append(str(vs[i]) if i == j else f"{vs[i]}-{vs[j]}")
        i = j + 1
    return ", ".join(out) if out else "-"


def _format_validate_all(res: dict, L: int, max_nodes: int) -> str:
    """The exhaustive App. D regression as a table: (M, W_wave) pairs per W_wave, M as ranges."""
    lines = [f"TIDE-RS validator, L = {L}, M in [2, {max_nodes}] (App. D)",
             f"base plans (M, W_wave, k, mode): {res['accepted']} accepted, "
             f"{res['rejected']} rejected",
             f"(M, W_wave) pairs: {len(res['accepted_pairs'])} accepted, "
             f"{len(res['rejected_pairs'])} rejected",
             f"{'W_wave':>6}  accepted M / rejected M"]
    for w in range(1, L + 1):
        acc = [m for m, ww in res["accepted_pairs"] if ww == w]
        rej = [m for m, ww in res["rejected_pairs"] if ww == w]
        lines.append(f"{w:>6}  accepted: {_ranges(acc)}")
        lines.append(f"{'':>6}  rejected: {_ranges(rej)}")
    verdict = "ok" if res["n_part_ok"] else f"FAILED: {res.get('n_part_failure', '')}"
    lines.append(f"n_part in {{2, 3, 4}} on every eligible base plan "
                 f"({res.get('n_part_checked', '?')} checks): {verdict}")
    if "seconds" in res:
        lines.append(f"took {res['seconds']:.1f} s")
    return "\n".join(lines)


def _validate_all(L: int, max_nodes: int, progress=sys.stderr, every_s: float = 5.0) -> dict:
    """_core.validate_all over M in [2, max_nodes], in parts of about a fifth of a second each
    (every M is independent), merged: Ctrl-C stops it between parts (the KeyboardInterrupt
    propagates), and a line of progress goes to `progress` every `every_s` seconds of long work."""
    from tide import _core

    _core.validate_all(L, max_nodes, max_nodes + 1)  # the arguments' ranges (PlanError), no work

    res: dict = {"accepted": 0, "rejected": 0, "accepted_pairs": [], "rejected_pairs": [],
                 "n_part_ok": True, "n_part_checked": 0, "n_part_failure": ""}
    start = last = time.monotonic()
    lo, width = 2, 8
    while lo <= max_nodes:
        hi = min(max_nodes, lo + width - 1)
        t0 = time.monotonic()
        part = _core.validate_all(L, hi, lo)
        took = time.monotonic() - t0
        for key in ("accepted", "rejected", "n_part_checked"):
            res[key] += part[key]
        res["accepted_pairs"] += part["accepted_pairs"]
        res["rejected_pairs"] += part["rejected_pairs"]
        if res["n_part_ok"] and not part["n_part_ok"]:
            res["n_part_ok"], res["n_part_failure"] = False, part["n_part_failure"]
        # The cost of one M grows with M: size the next part from this one's pace.
        width = max(1, min(4 * width, int(width * 0.2 / max(took, 1e-6))))
        lo = hi + 1
        now = time.monotonic()
        if progress is not None and now - last >= every_s and lo <= max_nodes:
            share = (hi * hi - 4) / max(1, max_nodes * max_nodes - 4)  # one M costs about M
            print(f"tide plan: --validate-all: M up to {hi} of {max_nodes} done (about "
                  f"{100 * share:.1f}% of the work), {now - start:.0f} s; Ctrl-C stops",
                  file=progress, flush=True)
            last = now
    res["seconds"] = time.monotonic() - start
    return res


def _plan_options(args: argparse.Namespace) -> dict[str, int]:
    return dict(w_wave=args.w_wave, k=args.k, n_part=args.n_part, n_stg=args.n_stg,
                chunk_bytes=args.chunk_bytes, sum_ctas=args.sum_ctas, land_ctas=args.land_ctas)


def _cmd_plan(args: argparse.Namespace) -> int:
    import tide
    from tide import _core

    if args.validate_all:
        if not hasattr(_core, "validate_all"):
            print("tide plan: error: --validate-all needs tide._core.validate_all (the TIDE-RS "
                  "validator), which this build does not have", file=sys.stderr)
            return 2
        try:
            res = _validate_all(args.gpus_per_node, args.max_nodes)
        except ValueError as e:  # tide.PlanError: --gpus-per-node / --max-nodes out of range
            print(f"tide plan: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("tide plan: --validate-all interrupted", file=sys.stderr)
            return 130
        print(_format_validate_all(res, args.gpus_per_node, args.max_nodes))
        return 0 if res["n_part_ok"] else 1
    try:
        title, sig = _signature(args)
        opts = _plan_options(args)
        planned, where = _shard_dims(sig, args.shard_dim, args.nodes * args.gpus_per_node)
        p = tide.plan(planned, tide.Topology(args.nodes, args.gpus_per_node), mode=args.mode, **opts)
    except (ValueError, OSError) as e:  # tide.PlanError is a ValueError
        print(f"tide plan: error: {e}", file=sys.stderr)
        return 2
    rows = memory_by_topology(sig, args.gpus_per_node, TABLE_NODES + (args.nodes,), **opts)
    if args.json:
        print(json.dumps(dict(group=title, **plan_dict(p), memory_by_topology=rows,
                              shard_dims=_shard_dim_lines(p, sig, where)), indent=1))
    else:
        print("\n".join([format_plan(p, title)] + _shard_dim_lines(p, sig, where)) + "\n\n"
              + format_memory_table(rows))
    return 0


def add_plan_command(sub) -> None:
    """Adds `plan` to an argparse sub-parser set (this CLI's, and the `tide` command's)."""
    pp = sub.add_parser("plan", help="plan a parameter group and print the memory model")
    _add_plan_args(pp)
    pp.set_defaults(run=_cmd_plan)


def main(argv: list[str] | None = None) -> int:
    """`python -m tide plan ...`: the planner alone (`tide demo` and `tide bench` use a framework:
    they are the `tide` command's, which has `plan` as well)."""
    ap = argparse.ArgumentParser(prog="python -m tide", description=__doc__.split("\n\n")[0],
                                 epilog="`tide demo` and `tide bench ...`: run the `tide` command "
                                        "(.venv/bin/tide after make; pip's console script)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_plan_command(sub)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
