"""The plan as text and data: `format_plan` (what `tide plan` and `tide demo` print) and
`plan_dict` (`tide plan --json`). Reads only the plan object; imports no framework.

`memory_by_topology` plans one signature on several topologies (M x L, both modes, the same
options) and returns TIDE's and FSDP2's live bytes per rank as rows; `format_memory_table` prints
those rows (`tide plan` and `tide demo`). A topology whose plan fails is a row with its
PlanError's reason."""
from __future__ import annotations

from typing import Any

GIB = float(1 << 30)


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
            *(["  one node: direct Level 1 (the SUM writes the output; no outbox, inbox, spare or LAND)"]
              if rs.get("direct") else []),
            f"  staging chunk {rs['E_chunk']} elements x {rs['n_chunks']} per "
            f"{'output' if rs.get('direct') else 'sub-slice'}",
            f"  sizing: {p.rs_sizing}",
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
    if mem["pull_arena"] is not None:  # [Note: pulled arena]: no ring slots, no TIDE-RS regions
        out += ["", f"Arena of a TIDE-AG that pulls ({_fmt_bytes(mem['pull_arena_bytes'])}: tide_xla's "
                "with fp32 shards; one-sided counters)"]
        for r in mem["pull_arena"]:
            out.append(f"  {r['name']:<10} {r['offset']:>14} {r['bytes']:>14}")
    return "\n".join(out)


MODES = ("in_place", "slot_reuse")
TABLE_NODES = (1, 2, 4, 8)
_RS_PARTS = ("staging", "inbox", "outbox", "spare")


def memory_row(p) -> dict[str, Any]:
    """TIDE vs FSDP2 live bytes of one plan; RS scratch also in output-sized blocks (S_fp32)."""
    mem, block = p.memory(), p.layout.S_fp32
    row = dict(nodes=p.nodes, gpus_per_node=p.gpus_per_node, mode=p.mode,
               tide_live_bytes=mem["live_tide_bytes"], tide_live_ns=mem["live_tide_ns"],
               fsdp2_live_bytes=mem["live_fsdp2_bytes"], fsdp2_live_ns=mem["live_fsdp2_ns"],
               ratio=mem["live_tide_bytes"] / mem["live_fsdp2_bytes"],
               block_bytes=block, rs_scratch_bytes=mem["area_rs_bytes"],
               rs_scratch_blocks=mem["area_rs_bytes"] / block)
    for k in _RS_PARTS:
        row[f"{k}_bytes"], row[f"{k}_blocks"] = mem[f"{k}_bytes"], mem[f"{k}_bytes"] / block
    return row


def memory_by_topology(sig, gpus_per_node: int, nodes: tuple[int, ...] = TABLE_NODES,
                       **options: int) -> list[dict[str, Any]]:
    """One row per (M, mode) for M in `nodes` at L = `gpus_per_node`; options as tide.plan's."""
    from tide.plan import PlanError, Topology, plan

    rows = []
    for M in sorted(set(nodes)):
        for mode in MODES:
            try:
                rows.append(memory_row(plan(sig, Topology(M, gpus_per_node), mode=mode, **options)))
            except PlanError as e:
                rows.append(dict(nodes=M, gpus_per_node=gpus_per_node, mode=mode, error=str(e)))
    return rows


def _num(x: float) -> str:
    return f"{round(x)}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def _unit(rows: list[dict[str, Any]]) -> tuple[str, int]:
    """GiB, or MiB/KiB/B when every byte count in the table is smaller."""
    top = max((r["fsdp2_live_bytes"] for r in rows if "error" not in r), default=0)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if top >= scale:
            return unit, scale
    return "B", 1


def _table_line(r: dict[str, Any], scale: int) -> str:
    head = f"  {str(r['nodes']) + ' x ' + str(r['gpus_per_node']):>8} {r['mode']:<10}"
    if "error" in r:
        return f"{head} plan fails: {r['error']}"
    parts = "/".join(_num(r[f"{k}_blocks"]) for k in _RS_PARTS)
    return (f"{head} {r['tide_live_bytes'] / scale:>9.3f} {r['tide_live_ns']:>7.3f} "
            f"{r['fsdp2_live_bytes'] / scale:>9.3f} {r['fsdp2_live_ns']:>7.3f} {r['ratio']:>6.3f} "
            f"{r['rs_scratch_bytes'] / scale:>9.3f} {_num(r['rs_scratch_blocks']):>7}  {parts}")


def format_memory_table(rows: list[dict[str, Any]]) -> str:
    """The rows of `memory_by_topology` as a table: GiB (a smaller unit when the whole group is
    smaller), NS, and the RS scratch in blocks of S_fp32 bytes."""
    unit, scale = _unit(rows)
    out = ["live bytes during a layer's backward: TIDE vs FSDP2 (per rank; block = the "
           "rank's fp32 RS output, S_fp32)",
           f"  {'M x L':>8} {'mode':<10} {'TIDE ' + unit:>9} {'NS':>7} {'FSDP2 ' + unit:>9} "
           f"{'NS':>7} {'ratio':>6} {'RS ' + unit:>9} {'blocks':>7}  "
           f"staging/inbox/outbox/spare (blocks)"]
    return "\n".join(out + [_table_line(r, scale) for r in rows])
