"""`tide` command line: `tide plan`, `tide demo`, `tide bench ag|rs|interference|train|layout`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

GIB = float(1 << 30)


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
    ap.add_argument("--n-part", type=int, default=1, help="sub-slice passes (default 1)")
    ap.add_argument("--n-stg", type=int, default=2, help="local staging slots (default 2)")
    ap.add_argument("--chunk-bytes", type=int, default=0, help="RS staging chunk (default: none)")
    ap.add_argument("--sum-ctas", type=int, default=0, help="C_sum (default: solver)")
    ap.add_argument("--land-ctas", type=int, default=0, help="C_mc (default: solver)")
    ap.add_argument("--dtype", default="bfloat16", help="AG and gradient dtype (default bfloat16)")
    ap.add_argument("--grad-dtype", help="gradient dtype (default --dtype)")
    ap.add_argument("--shard-dtype", help="sharded (master) dtype; differs from --dtype = cast")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--validate-all", action="store_true",
                    help="validate every base plan up to --max-nodes at --gpus-per-node")
    ap.add_argument("--max-nodes", type=int, default=1024, help="for --validate-all")


def _signature(args: argparse.Namespace):
    from tide import models
    from tide.plan import GroupSignature

    dt = dict(ag_dtype=args.dtype, grad_dtype=args.grad_dtype or args.dtype,
              shard_dtype=args.shard_dtype)
    if (args.model is None) == (args.shapes is None):
        raise ValueError("give exactly one of --model or --shapes")
    if args.shapes:
        with open(args.shapes) as f:
            obj = json.load(f)
        return f"{args.shapes}", GroupSignature.from_json(obj, **dt)
    group = args.group
    title = f"{args.model} / {group}"
    if group == "largest":
        title += f" ({models.largest_group_name(args.model)})"
    return title, models.signature(args.model, group, **dt)


def plan_dict(p) -> dict[str, Any]:
    """Everything the planner computed, as JSON-ready data."""
    g = p.layout
    params = []
    for i, (name, shape, pl) in enumerate(zip(p.names, p.shapes, g.params)):
        params.append(dict(index=i, name=name, shape=list(shape), D=pl.D, K=pl.K, R=pl.R, s=pl.s,
                           o=pl.o, valid_rows_last_rank=g.valid_rows(i, g.N - 1)))
    return dict(
        hash=f"{p.hash:#018x}",
        topology=dict(nodes=p.nodes, gpus_per_node=p.gpus_per_node, world=p.world),
        dtypes=dict(ag=p.ag_dtype, grad=p.grad_dtype, shard=p.shard_dtype),
        options=p.options,
        layout=dict(P=g.P, N=g.N, S=g.S, S_grad=g.S_grad, S_fp32=g.S_fp32, E=g.E, NS=g.NS,
                    B_pack=g.B_pack, params=params),
        ag=p.ag, rs=p.rs, solver=p.solver, memory=p.memory())


def _fmt_bytes(b: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def format_plan(p, title: str, max_params: int = 12) -> str:
    g, ag, rs, sv, mem = p.layout, p.ag, p.rs, p.solver, p.memory()
    cast = "cast" if p.shard_dtype != p.ag_dtype else "no cast"
    out = [f"TIDE plan: {title}",
           f"  topology  M={p.nodes} nodes x L={p.gpus_per_node} GPUs (N={p.world}), "
           f"mode {p.mode}, hash {p.hash:#018x}",
           f"  dtypes    ag {p.ag_dtype}, grad {p.grad_dtype}, shard {p.shard_dtype} ({cast})",
           "", f"Layout (P={g.P})",
           f"  S = {g.S} B ({_fmt_bytes(g.S)}) per-rank packed shard;  NS = {_fmt_bytes(g.NS)};  "
           f"S_fp32 = {_fmt_bytes(g.S_fp32)};  B_pack (FSDP2 fp32 RS input) = "
           f"{_fmt_bytes(g.B_pack)}",
           f"  {'p':>3} {'name':<32} {'shape':<20} {'R_p':>8} {'s_p':>12} {'o_p':>12} "
           f"{'valid@last':>10}"]
    for i, (name, shape, pl) in enumerate(zip(p.names, p.shapes, g.params)):
        if i == max_params:
            out.append(f"  ... {g.P - max_params} more parameters")
            break
        out.append(f"  {i:>3} {name[:32]:<32} {str(tuple(shape)):<20} {pl.R:>8} {pl.s:>12} "
                   f"{pl.o:>12} {g.valid_rows(i, g.N - 1):>10}")
    out += ["", "TIDE-AG",
            f"  {ag['rounds']} Bruck rounds, c_d = {ag['c']} (sum {sum(ag['c'])} = M-1), "
            f"receive stage {ag['stage_slots']} slots = {_fmt_bytes(ag['stage_bytes'])}",
            f"  scatter descriptors per rank: {ag['descriptors_per_rank']} coalesced, "
            f"{ag['flat_descriptors_per_rank']} flat",
            "", "TIDE-RS",
            f"  W_wave {rs['w_wave']}, {rs['waves']} waves, n_par {rs['n_par']} generations, "
            f"n_out {rs['n_out']} blocks/bank, n_part {rs['n_part']}, k {rs['k']}",
            f"  E_sub {rs['E_sub']} elements, block {_fmt_bytes(rs['block_bytes'])}; Level-1 "
            f"descriptors per rank: {rs['l1_descriptors_per_rank']} coalesced, "
            f"{rs['l1_flat_descriptors_per_rank']} flat",
            "", "Sizing solver (Eqs. 13-14, App. G)"]
    given = lambda key: "given" if sv[f"{key}_given"] else "solver"  # noqa: E731
    out.append(f"  k = {sv['k']} ({given('k')}), C_sum = {sv['sum_ctas']} ({given('sum_ctas')}), "
               f"C_mc = {sv['land_ctas']} ({given('land_ctas')}), N_rounds = {sv['rounds']}, "
               f"t_NIC = {sv['t_nic_s'] * 1e3:.2f} ms")
    out += ["", "Memory per rank during a layer's backward (Section 5.4)",
            f"  {'term':<44} {'bytes':>14} {'GiB':>9} {'NS':>8}"]

    def row(label: str, nbytes: int | None, ns: float) -> None:
        b = "" if nbytes is None else f"{nbytes:>14}"
        gib = "" if nbytes is None else f"{nbytes / GIB:>9.3f}"
        out.append(f"  {label:<44} {b:>14} {gib:>9} {ns:>8.3f}")

    row("AG ring slots (2 x NS)", mem["ring_bytes"], mem["ring_ns"])
    row("AG receive stage", mem["stage_bytes"], mem["stage_ns"])
    row("RS staging Area_RS (Eq. 10, as laid out)", mem["area_rs_bytes"], mem["area_rs_ns"])
    for k in ("staging", "inbox", "outbox", "spare"):
        row(f"  {k}", mem[f"{k}_bytes"], mem[f"{k}_ns"])
    row("previous layer's gradients (In-Place)", mem["prev_grad_bytes"], mem["prev_grad_ns"])
    row(f"TIDE total ({p.mode})", mem["live_tide_bytes"], mem["live_tide_ns"])
    row("FSDP2 total", mem["live_fsdp2_bytes"], mem["live_fsdp2_ns"])
    in_place = p.mode == "in_place"
    bound = mem["area_inplace_bound_ns"] if in_place else mem["area_slot_bound_ns"]
    out += ["  closed-form bounds:",
            f"    RS staging: In-Place staging (Eq. 11) {mem['area_inplace_bound_ns']:.3f} NS, "
            f"Slot-Reuse staging (Eq. 12, k={rs['k']}) {mem['area_slot_bound_ns']:.3f} NS",
            f"    TIDE total bound ({p.mode}) = (2 + 1/L) + {bound:.3f}"
            + (f" + {mem['prev_grad_ns']:.3f} (grads)" if in_place else "")
            + f" = {mem['live_tide_bound_ns']:.3f} NS vs FSDP2 {mem['live_fsdp2_ns']:.3f} NS",
            "", f"Arena ({_fmt_bytes(mem['arena_bytes'])}, 4 KiB-aligned regions)",
            f"  {'region':<10} {'offset':>14} {'bytes':>14}"]
    for r in mem["arena"]:
        out.append(f"  {r['name']:<10} {r['offset']:>14} {r['bytes']:>14}")
    return "\n".join(out)


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


def _cmd_plan(args: argparse.Namespace) -> int:
    import tide
    from tide import _core

    if args.validate_all:
        if not hasattr(_core, "validate_all"):
            print("tide plan: error: --validate-all needs tide._core.validate_all (the TIDE-RS "
                  "validator), which this build does not have", file=sys.stderr)
            return 2
        res = _core.validate_all(args.gpus_per_node, args.max_nodes)
        print(_format_validate_all(res, args.gpus_per_node, args.max_nodes))
        return 0 if res["n_part_ok"] else 1
    try:
        title, sig = _signature(args)
        p = tide.plan(sig, tide.Topology(args.nodes, args.gpus_per_node), mode=args.mode,
                      w_wave=args.w_wave, k=args.k, n_part=args.n_part, n_stg=args.n_stg,
                      chunk_bytes=args.chunk_bytes, sum_ctas=args.sum_ctas,
                      land_ctas=args.land_ctas)
    except (ValueError, OSError) as e:  # tide.PlanError is a ValueError
        print(f"tide plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dict(group=title, **plan_dict(p)), indent=1))
    else:
        print(format_plan(p, title))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from tide import demo
    if args.steps < 2:
        print("tide demo: error: --steps must be >= 2 (step 1 is the profiled one)",
              file=sys.stderr)
        return 2
    return demo.main(device=args.device, train_steps=None if args.no_train else args.steps)


def _cmd_bench(which: str, rest: list[str]) -> int:
    if which in ("ag", "rs"):
        from tide.bench import collectives
        return collectives.main(rest, op=which) or 0
    if which == "interference":
        from tide.bench import interference
        return interference.main(rest) or 0
    if which == "train":
        from tide.bench import train
        return train.main(rest) or 0
    if which == "hostcall":
        from tide.bench import hostcall
        return hostcall.main(rest) or 0
    from tide.bench import layout
    return layout.main(rest) or 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tide", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan", help="plan a parameter group and print the memory model")
    _add_plan_args(pp)
    dp = sub.add_parser("demo", help="the main job: TIDE-AG/RS on a virtual cluster, checked; "
                        "FSDP2 training with and without TIDE, checked bit for bit; the "
                        "planner's view of Llama-3.1-70B on 8x8 GPUs")
    dp.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the training section runs (auto: the GPUs when the GPU path "
                         "can run, else 2 nodes x 2 gloo processes on the CPU)")
    dp.add_argument("--steps", type=int, default=4, help="AdamW steps per training run")
    dp.add_argument("--no-train", action="store_true", help="skip the training section")
    bp = sub.add_parser("bench", help="benchmarks: TIDE and the stock path side by side",
                        add_help=False)
    bp.add_argument("which", choices=["ag", "rs", "interference", "train", "layout", "hostcall"],
                    help="ag/rs: latency tables (paper Tables 7, 8); interference: victim slowdown "
                         "(Tables 4, 6); train: step time, memory, loss; layout: one GPU, N virtual "
                         "ranks; hostcall: host time per call of tide_torch's CUDA path")
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "bench":
        return _cmd_bench(args.which, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "plan":
        return _cmd_plan(args)
    return _cmd_demo(args)


if __name__ == "__main__":
    sys.exit(main())
