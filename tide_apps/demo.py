"""`tide demo`: the main job.

1. TIDE-AG and TIDE-RS on a virtual cluster (the CPU executor, or the CUDA executor when a GPU is
   usable) for a small Llama-style block, checked against references;
2. a small Llama-style model trained with FSDP2, stock and with ``tide_torch`` (In-Place and
   Slot-Reuse), on the same data on every rank: parameters must agree bit for bit; what TIDE
   removed (FSDP2's layout copies counted by torch.profiler, their bytes, per-call buffers vs
   TIDE's arena). CPU: 2 nodes x 2 as gloo processes; with GPUs: one rank per GPU
   (tide_apps/demo_train.py, imported only when it trains: without torch the rest still runs);
3. what TIDE removes per call and the memory model (TIDE's and FSDP2's live bytes for the block
   at 1 x L and M x L), then the planner's view of Llama-3.1-70B.
"""
from __future__ import annotations

import importlib.util
import time

import numpy as np

import tide
from tide import _core
from tide.report import format_memory_table, memory_by_topology

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None


def small_llama_block(hidden: int = 192, kv: int = 48, mlp: int = 520) -> tide.GroupSignature:
    """One decoder block in Llama's shapes, scaled down (dim-0 sizes not divisible by N)."""
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (mlp, hidden), (mlp, hidden), (hidden, mlp), (hidden,), (hidden,)]
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "input_norm", "post_norm"]
    return tide.GroupSignature(shapes=shapes, names=names)


def _np(x) -> np.ndarray:
    """numpy view of an executor output (numpy on the CPU cluster, torch CUDA on the GPU one)."""
    if hasattr(x, "detach"):  # torch tensor: move to host, keep bf16 bits through int16
        import torch
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)
        return t.numpy()
    return np.asarray(x)


def _backend() -> str:
    return "cuda" if _core.cuda.available() else "cpu"


def _shards(plan, sig, full_params):
    """FSDP2's dim-0 shards, zero-padded to R_p rows: shards[r][p]."""
    N, L = plan.layout.N, plan.layout
    out = []
    for r in range(N):
        row = []
        for p, w in enumerate(full_params):
            R = L.params[p].R
            pad = np.zeros((N * R,) + w.shape[1:], dtype=w.dtype)
            pad[: w.shape[0]] = w
            row.append(pad[r * R:(r + 1) * R].copy())
        out.append(row)
    return out


def _rs_reference(plan, grads, scale):
    """fp64 reduce-scatter reference in FSDP2's packed fp32 per-rank layout."""
    N, lay = plan.layout.N, plan.layout
    outs = []
    for r in range(N):
        pieces = []
        for p in range(lay.P):
            R, K = lay.params[p].R, lay.params[p].K
            total = sum(np.asarray(g[p], np.float64).reshape(g[p].shape[0], -1) for g in grads)
            pad = np.zeros((N * R, K))
            pad[: total.shape[0]] = total
            pieces.append(pad[r * R:(r + 1) * R].reshape(-1))
        outs.append(scale * np.concatenate(pieces))
    return outs


def run(topo: tide.Topology | None = None, seed: int = 0) -> dict:
    """Runs the demo's checks and returns what it printed as numbers (used by the tests)."""
    topo = topo or tide.Topology(nodes=2, gpus_per_node=2)
    backend = _backend()
    sig = small_llama_block()
    N = topo.world
    rng = np.random.default_rng(seed)
    res: dict = {"backend": backend, "world": N}
    print(f"== TIDE on a virtual cluster: {topo.nodes} nodes x {topo.gpus_per_node} GPUs "
          f"(N={N}), backend={backend}"
          + ("" if backend == "cuda" else " (CPU emulation: no GPU here)"))
    vc = tide.VirtualCluster(topo, backend=backend)
    for mode in ("in_place", "slot_reuse"):
        plan = tide.plan(sig, topo, mode=mode)
        # TIDE-AG: random bf16 parameters; every rank must see every parameter exactly.
        params = [rng.standard_normal(s).astype(BF16) for s in sig.shapes]
        shards = _shards(plan, sig, params)
        t0 = time.perf_counter()
        full = vc.all_gather(plan, shards)
        t_ag = time.perf_counter() - t0
        ag_ok = all(np.array_equal(_np(full[r][p]).view(np.uint16),
                                   params[p].view(np.uint16))
                    for r in range(N) for p in range(len(params)))
        # TIDE-RS, (1) standard-normal bf16 gradients against an fp64 reference.
        grads = [[rng.standard_normal(s).astype(BF16) for s in sig.shapes] for _ in range(N)]
        scale = 1.0 / N  # FSDP2's AVG folded into alpha
        t0 = time.perf_counter()
        outs = vc.reduce_scatter(plan, grads, scale=scale)
        t_rs = time.perf_counter() - t0
        ref = _rs_reference(plan, grads, scale)
        err = max(float(np.max(np.abs(_np(o).astype(np.float64) - y))) / max(1.0, float(np.max(np.abs(y))))
                  for o, y in zip(outs, ref))
        # (2) integer gradients: every partial sum exact, so the result must equal the plain
        # fp32 sum bit for bit.
        igrads = [[rng.integers(-64, 64, size=s).astype(BF16) for s in sig.shapes] for _ in range(N)]
        iouts = vc.reduce_scatter(plan, igrads, scale=1.0)
        iref = _rs_reference(plan, igrads, 1.0)
        exact = all(np.array_equal(_np(o).astype(np.float32), y.astype(np.float32))
                    for o, y in zip(iouts, iref))
        res[mode] = dict(ag_bitexact=ag_ok, rs_rel_err=err, rs_int_bitexact=exact)
        print(f"  {mode:10s} AG bit-exact on all {N} ranks: {'yes' if ag_ok else 'NO'} "
              f"({t_ag * 1e3:.0f} ms) | RS vs fp64: max rel err {err:.1e} (bound 1e-05) "
              f"| RS integer data bit-exact: {'yes' if exact else 'NO'} ({t_rs * 1e3:.0f} ms)")

    return res


def removals(topo: tide.Topology | None = None) -> dict:
    """Prints what TIDE removes from FSDP2's path for the demo's block (the memory model)."""
    topo = topo or tide.Topology(nodes=2, gpus_per_node=2)
    sig = small_llama_block()
    res: dict = {}
    plan = tide.plan(sig, topo, mode="in_place")
    lay, mem = plan.layout, plan.memory()
    ns = lay.S * lay.N
    print(f"\n== What TIDE removes from FSDP2's path for this block (per rank, per call, "
          f"{topo.nodes} x {topo.gpus_per_node})")
    print(f"  all-gather copy-out (split_with_sizes_copy): {2 * ns:,} bytes of HBM traffic, "
          f"{lay.P} copies -> 0 (shards land at Landing(p, r))")
    print(f"  all-gather copy-in (all_gather_copy_in):     {2 * lay.S:,} bytes -> 0 "
          f"(resident shards are read in place)")
    big = tide.plan(sig, tide.Topology(8, 8), mode="in_place")
    print(f"  reduce-scatter pack (_chunk_cat, fp32):      buffer of {lay.B_pack:,} bytes -> "
          f"TIDE RS staging {mem['area_rs_bytes']:,} bytes here; at 8 x 8 GPUs "
          f"{big.layout.B_pack:,} -> {big.memory()['area_rs_bytes']:,} "
          f"(FSDP2's pack is the whole group in fp32; TIDE's staging shrinks as 1/M)")
    print(f"  programs checked statically (I1-I4) before their first run; "
          f"plan hash {plan.hash:#018x} (what ranks compare to agree on a plan)")
    res["b_pack"], res["area_rs"] = lay.B_pack, mem["area_rs_bytes"]
    res["memory_by_topology"] = memory_by_topology(sig, topo.gpus_per_node, (1, topo.nodes))
    print("\n  " + format_memory_table(res["memory_by_topology"]).replace("\n", "\n  "))
    return res


# ---- training ----------------------------------------------------------------------------------
_RUN_TITLES = {"stock": "stock FSDP2", "in_place": "TIDE In-Place", "slot_reuse": "TIDE Slot-Reuse"}
_OP_TITLES = {"aten::split_with_sizes_copy": "split_with_sizes_copy (AG copy-out)",
              "aten::_chunk_cat": "_chunk_cat (RS fp32 pack)",
              "fsdp::all_gather_copy_in": "all_gather_copy_in (AG copy-in)"}


def _pick_device(device: str) -> str:
    """"auto" -> "cuda" when the GPU path can run, else "cpu" (saying why when a GPU is there)."""
    from tide_apps import demo_train
    if device == "cpu":
        return "cpu"
    why = demo_train.gpu_unavailable_reason()
    if why is None:
        return "cuda"
    if device == "cuda" or why != "torch sees no CUDA device":
        print(f"  GPU path unavailable: {why}; training on the CPU virtual cluster instead")
    return "cpu"


def train(device: str = "auto", cfg=None) -> dict | None:
    """The training section: prints it and returns the measured result (rank 0's JSON), or None
    when torch is not installed. ``cfg``: a ``tide_apps.demo_train.Config``."""
    if importlib.util.find_spec("torch") is None:
        print("\n== Training with FSDP2: skipped (torch is not installed: pip install '.[torch]')")
        return None
    from tide_apps import demo_train
    print()
    device = _pick_device(device)
    res = None
    if device == "cuda":
        try:
            res = demo_train.run("cuda", cfg)
        except Exception as e:  # noqa: BLE001 - the demo goes on on the CPU, saying why
            last = (str(e).strip().splitlines() or [""])[-1]  # a rank's error, not its traceback
            print(f"  GPU training failed ({type(e).__name__}: {last}); "
                  "training on the CPU virtual cluster instead")
        else:
            print_training(res)
            if not _tide_served(res):
                print("  TIDE served no collective on the GPU run (see the fallbacks above); "
                      "the CPU virtual cluster shows TIDE's path:\n")
                res = None
    if res is None:
        res = demo_train.run("cpu", cfg)
        print_training(res)
    return res


def _tide_served(res: dict) -> bool:
    calls = res["runs"]["in_place"]["tide_calls"] or {}
    return calls.get("ag_tide", 0) > 0 and calls.get("rs_tide", 0) > 0


def training_ok(res: dict) -> bool:
    """Bitwise agreement with stock FSDP2 in both modes, and no layout copy left with TIDE."""
    agree = all(a["bitwise"] and a["losses_equal"] for a in res["agreement"].values())
    no_copies = all(c["calls"] == 0 for name in ("in_place", "slot_reuse")
                    for c in res["runs"][name]["copy_ops"].values())
    return agree and no_copies and _tide_served(res)


def print_training(res: dict) -> None:
    c, runs, (M, L) = res["config"], res["runs"], res["topology"]
    where = (f"{M} node(s) x {L} GPUs, one process per GPU ({res['device_name']})"
             if res["device"] == "cuda" else
             f"{M} nodes x {L} GPUs as {res['world']} gloo processes (CPU emulation)")
    print(f"== Training a small Llama-style model with FSDP2: {where}")
    tide_run = runs["in_place"]
    served = len((tide_run["memory"] or {}).get("groups", {}))
    print(f"  {c['layers']} blocks + root (vocab {c['vocab']}, dim {c['dim']}), {c['steps']} AdamW "
          f"steps, MixedPrecisionPolicy(bf16, fp32), the same tokens on every rank, so every "
          f"gradient sum is exact\n  TIDE: transport {tide_run['transport']}, {served} FSDP2 "
          f"group(s) served, stock fallbacks: {tide_run['fallbacks'] or 'none'}")
    print("\n  step " + "".join(f"{'loss ' + _RUN_TITLES[n]:>26s}" for n in runs))
    for i in range(c["steps"]):
        print(f"  {i:4d} " + "".join(f"{runs[n]['losses'][i]:26.9f}" for n in runs))
    agree = res["agreement"]
    yes = {True: "yes", False: "NO"}
    print("  parameters bitwise equal to stock FSDP2 on every rank: "
          + ", ".join(f"{_RUN_TITLES[n][5:]} {yes[a['bitwise']]}"
                      + ("" if a["bitwise"] else f" (max |diff| {a['max_abs_diff']:.3e})")
                      for n, a in agree.items())
          + f"; losses equal: {yes[all(a['losses_equal'] for a in agree.values())]}")
    if res["device"] == "cuda":
        print("  step time (median, first and profiled steps excluded): "
              + ", ".join(f"{_RUN_TITLES[n]} {runs[n]['step_ms']:.2f} ms" for n in runs))

    print(f"\n  FSDP2's layout copies in one training step (torch.profiler, step "
          f"{c['profile_step']}, rank 0): calls (bytes written)")
    print(f"  {'op':38s}" + "".join(f"{_RUN_TITLES[n]:>22s}" for n in runs))
    for op, title in _OP_TITLES.items():
        cells = []
        for n in runs:
            o = runs[n]["copy_ops"][op]
            cells.append(f"{o['calls']:d} ({o['bytes']:,} B)" if o["calls"] else "0")
        print(f"  {title:38s}" + "".join(f"{x:>22s}" for x in cells))
    for n in ("in_place", "slot_reuse"):
        k = runs[n]["tide_calls"] or {}
        print(f"  {_RUN_TITLES[n]} ran {k.get('ag_tide', 0)} all-gathers and "
              f"{k.get('rs_tide', 0)} reduce-scatters through TIDE in that step "
              f"({k.get('ag_stock', 0) + k.get('rs_stock', 0)} handed to stock)")

    mem = tide_run["memory"]
    if not mem or not mem.get("groups"):
        return
    print("\n  Buffers, bytes per rank: FSDP2 allocates its all-gather output on every all-gather "
          "(and the unsharded parameters\n  it copies out into, as large again) and its packed "
          "fp32 reduce-scatter input on every reduce-scatter;\n  TIDE allocates one arena, once, "
          "at enable()")
    print(f"  {'group':10s} {'TIDE slot':>10s} {'FSDP2 AG output':>16s} {'FSDP2 RS input':>16s}"
          f" {'FSDP2 RS output':>19s}")
    for fqn, g in mem["groups"].items():
        print(f"  {fqn:10s} {g['slot']:>10s} {g['unsharded_bytes']:>16,} "
              f"{g['stock_rs_input_bytes']:>16,} {g['rs_output_bytes']:>19,}")
    regions = ", ".join(f"{k} {v:,}" for k, v in mem["regions"].items() if v)
    print(f"  TIDE arena: {mem['arena_bytes']:,} B ({regions}).\n  The unsharded parameters "
          f"are views of the arena's landing slots (ring0/ring1/fixed): no separate all-gather "
          f"output, no copy-out,\n  no fp32 pack buffer; TIDE-RS writes FSDP2's fp32 RS output in place. At this toy size the executor's "
          f"counters dominate the arena; the 70B memory model below is the at-scale picture.")


def verdict(cluster_ok: bool, train_ok: bool | None) -> str:
    """The demo's last line: one verdict over its checks (``train_ok`` None: not trained)."""
    ok = cluster_ok and train_ok is not False
    train = {None: "not run", True: "bitwise equal to stock FSDP2, copies removed",
             False: "FAILED (see the training section)"}[train_ok]
    return (f"== Agreement check: {'PASS' if ok else 'FAIL'} (virtual-cluster TIDE-AG/RS: "
            f"{'exact' if cluster_ok else 'FAILED'}; FSDP2 training: {train})")


def main(device: str = "auto", train_steps: int | None = 4) -> int:
    """``tide demo``: ``device`` "auto" | "cpu" | "cuda" for the training section;
    ``train_steps`` None skips training."""
    from tide import models
    from tide.report import format_plan

    res = run()
    cluster_ok = all(res[m]["ag_bitexact"] and res[m]["rs_int_bitexact"]
                     and res[m]["rs_rel_err"] <= 1e-5 for m in ("in_place", "slot_reuse"))
    removals()
    train_ok = None  # None: not trained (--no-train, or no torch)
    if train_steps is not None:
        from dataclasses import replace
        cfg = None
        if importlib.util.find_spec("torch") is not None:
            from tide_apps import demo_train
            cfg = replace(demo_train.Config(), steps=train_steps)
        tres = train(device, cfg)
        if tres is not None:
            train_ok = training_ok(tres)
    ok = cluster_ok and train_ok is not False
    print("\n== The planner's view of Llama-3.1-70B on 8 nodes x 8 GPUs\n")
    topo = tide.Topology(8, 8)
    for group in ("block", "largest"):
        sig = models.signature("llama3.1-70b", group)
        print(format_plan(tide.plan(sig, topo, mode="in_place"), f"llama3.1-70b / {group}",
                          max_params=9))
        print()
    print(verdict(cluster_ok, train_ok))
    return 0 if ok else 1
