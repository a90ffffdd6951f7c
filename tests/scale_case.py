"""One TIDE collective at scale on the CPU virtual cluster, checked bit-exactly, with its wall
time and peak RSS (run by tests/test_scale.py in a fresh process, so the RSS is this run's own).

    python tests/scale_case.py {ag|rs} [M] [L]      (default 1024 x 8)

Integer-valued bf16 data keeps every sum exact, so outputs must equal a numpy int64 reference
bit for bit. Prints one summary line per check and `SCALE <collective> ... PASS` last; exits
non-zero on any mismatch or when the peak RSS reaches RSS_LIMIT_GB.
"""
from __future__ import annotations

import os
import resource
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tide  # noqa: E402
from tide import _core  # noqa: E402
from tide.plan import rs_bank  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ag_helpers import shard  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
RSS_LIMIT_GB = 8.0
WORKERS = 2


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def run_ag(M: int, L: int) -> dict:
    N = M * L
    shapes = [(2 * N,), (N + 5, 1)]  # the second leaves ranks >= 6 holding padding only
    topo = tide.Topology(nodes=M, gpus_per_node=L)
    plan = tide.plan(tide.GroupSignature(shapes=shapes), topo)
    rng = np.random.default_rng(13)
    fulls = [rng.integers(-128, 128, size=s).astype(np.float32).astype(BF16) for s in shapes]
    shards = shard(fulls, plan, N)
    vc = tide.VirtualCluster(topo, timeout_s=600, workers=WORKERS)
    t0 = time.perf_counter()
    out = vc.all_gather(plan, shards, poison=True)
    wall = time.perf_counter() - t0
    bad = [(r, p) for r in range(N) for p in range(len(shapes))
           if out[r][p].shape != fulls[p].shape or not np.array_equal(out[r][p].view(np.uint16), fulls[p].view(np.uint16))]
    assert not bad, f"AG {M}x{L}: {len(bad)} (rank, param) outputs differ from the reference, first {bad[:4]}"
    print(f"AG {M}x{L}: all {N} ranks x {len(shapes)} params bit-equal to the reference")
    mem = plan.memory()
    assert vc.arena(plan).bytes_per_rank == mem["arena_bytes"], (vc.arena(plan).bytes_per_rank, mem["arena_bytes"])
    print(f"AG {M}x{L}: arena bytes per rank {mem['arena_bytes']} == plan.memory()")
    # Descriptor counts of a few ranks' programs against the planner's formulas.
    ag = _core.plan_ag(plan)
    progs = vc.session(plan, "all_gather", ring_slot=0, resident=True, multicast=False,
                       expert_lane=False)[0].programs("all_gather", 1)
    for r in sorted({0, L - 1, N // 2 + 3, N - 1}):
        scat, puts, _ = progs.ag_stats(r)
        assert scat == _core.ag_scatter_descriptors(plan, r // L), (r, scat)
        assert puts == 2 * ag.rounds, (r, puts)
    print(f"AG {M}x{L}: scatter descriptors and PUTs of sampled ranks == planner formulas")
    return {"wall_s": wall, "ops_rank0": progs.num_ops(0)}


def run_rs(M: int, L: int) -> dict:
    N = M * L
    shapes = [(N // 2 + 5, 3), (7,)]  # padding rows and ranks without any gradient rows
    topo = tide.Topology(nodes=M, gpus_per_node=L)
    # Slot-Reuse: In-Place keeps M - 1 outbox blocks per bank (4.3 GB of arena at 1024 x 8).
    plan = tide.plan(tide.GroupSignature(shapes=shapes, grad_dtype="bfloat16"), topo, mode="slot_reuse")
    rng = np.random.default_rng(7)
    ints = [rng.integers(-3, 4, size=(N,) + s, dtype=np.int8) for s in shapes]
    G = [a.astype(BF16) for a in ints]
    grads = [[G[p][r] for p in range(len(shapes))] for r in range(N)]
    vc = tide.VirtualCluster(topo, timeout_s=600, workers=WORKERS, lean=True)
    lay = plan.layout
    walls = []
    for call in range(2):  # both outbox banks; the second call accumulates onto the first
        t0 = time.perf_counter()
        outs = vc.reduce_scatter(plan, grads, accumulate=None if call == 0 else outs)
        walls.append(time.perf_counter() - t0)
        for p in range(len(shapes)):
            tot = ints[p].sum(axis=0, dtype=np.int64).reshape(-1) * (call + 1)
            e, o = lay.params[p].e, lay.params[p].o32
            full = np.zeros(N * e, dtype=np.float32)
            full[: tot.size] = tot
            got = np.stack([outs[r][o:o + e] for r in range(N)]).reshape(-1)
            assert np.array_equal(got.view(np.uint32), full.view(np.uint32)), \
                f"RS {M}x{L} call {call + 1}: param {p} differs from the reference"
        print(f"RS {M}x{L} call {call + 1}: all {N} ranks' outputs bit-equal to the reference")
    mem = plan.memory()
    assert vc.rs_arena(plan).bytes_per_rank == mem["arena_bytes"], (vc.rs_arena(plan).bytes_per_rank, mem["arena_bytes"])
    print(f"RS {M}x{L}: arena bytes per rank {mem['arena_bytes']} == plan.memory()")
    rs = plan.rs_schedule
    gen = vc.session(plan, "reduce_scatter")[0].programs("reduce_scatter", 1)  # call 1's (generated) set
    assert gen.generated
    worst, ops = 0, 0
    for r in list(range(L)) + [N // 2 + 3, N - 1]:  # node 0's ranks give the planner's worst case
        st = _core.rs_program_stats(gen, r)
        assert st["l1_descriptors"] == len(_core.rs_level1_copies(plan, r)), (r, st)
        assert st["puts"] == rs.n_part * (M - 1), (r, st)
        assert st["sums"] == rs.n_part * M * rs.n_chunks * (1 if rs.n_chunks == 1 else L), (r, st)
        if r < L:
            worst = max(worst, st["l1_descriptors"])
        ops = max(ops, st["ops"])
    assert worst == rs.l1_descriptors_per_rank, (worst, rs.l1_descriptors_per_rank)
    print(f"RS {M}x{L}: Level-1 descriptors, PUTs and SUMs of sampled ranks == planner formulas "
          f"({worst} L1 descriptors, {ops} ops per rank)")
    return {"wall_s": sum(walls), "calls_s": walls, "ops_rank0": ops}


def main(argv: list[str]) -> int:
    which = argv[1] if len(argv) > 1 else "rs"
    M = int(argv[2]) if len(argv) > 2 else 1024
    L = int(argv[3]) if len(argv) > 3 else 8
    t0 = time.perf_counter()
    res = {"ag": run_ag, "rs": run_rs}[which](M, L)
    total = time.perf_counter() - t0
    rss = peak_rss_gb()
    ok = rss < RSS_LIMIT_GB
    print(f"SCALE {which.upper()} {M}x{L} ({M * L} ranks): collective wall {res['wall_s']:.1f} s, "
          f"total {total:.1f} s, peak RSS {rss:.2f} GB (limit {RSS_LIMIT_GB}), "
          f"ops/rank {res['ops_rank0']} {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
