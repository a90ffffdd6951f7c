"""RS programs: the static checker over a grid, measured counts vs the planner, fault detection,
and the flat staging of Fig. 10b."""
import itertools

import numpy as np
import pytest

import tide
from tide import _core
from tide.plan import rs_bank
from rs_helpers import programs_without_waits

TAGS = _core.rs_op_tags
GEN = _core.op_tags
FAULT = _core.fault_kinds


def shapes_for(M, L, n_part=1):
    # three parameters, one with padded final rows, large enough for n_part passes
    return [(5 * M * L + 3, 8), (7,), (16 * M * L, 2 * n_part)]


def make(M, L, mode="in_place", **kw):
    kw.setdefault("n_part", 1)  # the grid names its pass counts (the planner's choice: test_plan_memory)
    n_part = kw["n_part"]
    return tide.plan(tide.GroupSignature(shapes=shapes_for(M, L, n_part)), tide.Topology(M, L), mode, **kw)


def calls_for(plan, n_calls=3, mutate=None):
    """Per-rank call lists with the banks alternating (b = seq mod 2)."""
    sets = {b: _core.build_rs_programs(plan, bank=b) for b in (0, 1)}
    if mutate:
        for ps in sets.values():
            mutate(ps)
    return [[(sets[rs_bank(seq)], seq) for seq in range(1, n_calls + 1)] for _ in range(plan.nodes * plan.gpus_per_node)]


GRID = [
    # (M, L, mode, options)
    *[(M, L, mode, {}) for M, L, mode in itertools.product([1, 2, 3, 5], [1, 2, 4, 8], ["in_place", "slot_reuse"])],
    *[(M, 2, "slot_reuse", {"k": 1}) for M in range(6, 17)],
    (9, 8, "in_place", {"w_wave": 8}),
    (9, 4, "slot_reuse", {"w_wave": 2, "k": 1, "n_part": 2}),
    (10, 4, "slot_reuse", {"w_wave": 2, "k": 1}),
    (12, 4, "in_place", {"w_wave": 4, "k": 3, "n_part": 3}),
    (7, 8, "slot_reuse", {"w_wave": 3, "k": 2}),
    (16, 2, "in_place", {"w_wave": 1, "k": 1, "n_stg": 1}),
    (4, 4, "in_place", {"chunk_bytes": 8, "n_stg": 1}),
    (3, 8, "slot_reuse", {"chunk_bytes": 16, "n_stg": 3, "n_part": 2}),
    (64, 1, "slot_reuse", {"k": 4}),
    (64, 2, "in_place", {"w_wave": 2}),
    (64, 2, "slot_reuse", {"k": 4, "n_part": 2}),
    (64, 1, "in_place", {"w_wave": 1, "n_part": 2}),
]


@pytest.mark.parametrize("M,L,mode,kw", GRID, ids=lambda v: str(v))
def test_checker_accepts_rs_programs(M, L, mode, kw):
    plan = make(M, L, mode, **kw)
    ok, errors = _core.check_calls(calls_for(plan))
    assert ok, errors


def test_measured_counts_equal_the_planner():
    for M, L, kw in [(3, 4, {}), (4, 8, {"n_part": 2}), (5, 2, {"chunk_bytes": 8}), (2, 8, {"w_wave": 2})]:
        plan = make(M, L, **kw)
        rs = plan.rs_schedule
        ps = _core.build_rs_programs(plan)
        worst = 0
        for r in range(M * L):
            st = _core.rs_program_stats(ps, r)
            assert st["l1_descriptors"] == len(_core.rs_level1_copies(plan, r))
            if r < L:
                worst = max(worst, st["l1_descriptors"])
            assert st["puts"] == rs.n_part * (M - 1)
            # one SUM per unit unchunked, else one per block row of each chunk holding live columns
            owned = [rs.subslices[ps * L + (r % L + c % M) % L] for ps in range(rs.n_part) for c in range(1, M + 1)]
            live = sum(1 for sub in owned for ch in range(rs.n_chunks) if ch * rs.E_chunk < sub.length)
            assert st["sums"] == (rs.n_part * M if rs.n_chunks == 1 else L * live)
            assert st["lands"] == sum(1 for w in rs.waves_info for s in range(L)
                                      if rs.subslices[w["pass"] * L + s].length > 0)
            assert st["zeros"] == sum(bin(w["zero_mask"][r % L]).count("1") for w in rs.waves_info)
        assert worst == rs.l1_descriptors_per_rank


def _run_faulty(plan, kind, tag, rank=0, n_calls=3):
    """Inject into both bank programs; True when the checker rejects or the executor reports."""
    applied = []

    def mutate(ps):
        applied.append(ps.inject_fault(FAULT[kind], rank, tag))

    calls = calls_for(plan, n_calls, mutate)
    assert all(applied), f"{kind} found no op with tag {tag}"
    ok, errors = _core.check_calls(calls)
    return not ok, errors


FAULTS = [
    # (name, fault kind, op tag, (M, L, mode, options), ranks) -- configurations where the op matters
    ("stale zeroing skipped", "skip_zero", 0, (10, 4, "slot_reuse", {"w_wave": 2, "k": 1}), None),
    ("stale zeroing skipped, one wave", "skip_zero", 0, (2, 8, "in_place", {}), None),
    ("inbox credit dropped", "drop_credit", TAGS["InboxCredit"], (10, 4, "slot_reuse", {"w_wave": 2, "k": 1}), None),
    ("staging credit dropped", "drop_credit", TAGS["StagingFree"], (2, 8, "in_place", {}), None),
    ("credit wait dropped", "drop_wait", GEN["CreditWait"], (10, 4, "slot_reuse", {"w_wave": 2, "k": 1}), None),
    ("arrival wait dropped", "drop_wait", GEN["ArrivalWait"], (3, 4, "in_place", {}), None),
    ("generation wait dropped", "drop_wait", TAGS["GenWait"], (9, 2, "in_place", {"w_wave": 2, "k": 2}), None),
    ("push wait dropped", "drop_wait", TAGS["PushWait"], (2, 8, "in_place", {}), None),
    # The first staging wait guards the previous call's last unit; on some ranks the checker's
    # caller model (call e+1 issued after call e is consumed) already orders it, so rank 0 only.
    ("staging wait dropped", "drop_wait", TAGS["StagingWait"], (9, 2, "in_place", {"n_stg": 1}), (0,)),
    ("ready wait dropped", "drop_wait", TAGS["ReadyWait"], (2, 4, "in_place", {}), None),
    ("inbox reused early", "early_reuse", TAGS["Put"], (10, 4, "slot_reuse", {"w_wave": 2, "k": 1}), None),
    ("staging reused early", "early_reuse", TAGS["Push"], (2, 8, "in_place", {}), None),
    ("sum fence dropped", "drop_fence", TAGS["SumWait"], (2, 8, "in_place", {}), None),
    ("bank fence dropped", "drop_fence", TAGS["BankWait"], (2, 8, "in_place", {}), None),
    ("outbox reused early", "drop_fence", TAGS["OutboxWait"], (10, 4, "slot_reuse", {"w_wave": 2, "k": 1}), None),
    ("spare reused early", "drop_fence", TAGS["SpareWait"], (3, 4, "in_place", {"n_part": 2}), None),
    # one node ([Note: direct Level 1]), chunked staging reused through n_stg slots
    ("direct: staging reused early", "early_reuse", TAGS["Push"], (1, 4, "in_place", {"chunk_bytes": 16}), None),
    ("direct: staging credit dropped", "drop_credit", TAGS["StagingFree"], (1, 4, "in_place", {"chunk_bytes": 16}), None),
    ("direct: push wait dropped", "drop_wait", TAGS["PushWait"], (1, 4, "in_place", {"chunk_bytes": 16}), None),
    ("direct: staging wait dropped", "drop_wait", TAGS["StagingWait"], (1, 4, "in_place", {"chunk_bytes": 16, "n_stg": 1}), (0,)),
    ("direct: pushes not joined before release", "drop_fence", TAGS["Pushed"], (1, 4, "in_place", {"chunk_bytes": 16}), None),
    ("direct: push stream starts before the call", "drop_fence", TAGS["PushStart"], (1, 4, "in_place", {"chunk_bytes": 16}), None),
]


@pytest.mark.parametrize("name,kind,tag,cfg,ranks", FAULTS, ids=[f[0] for f in FAULTS])
def test_rs_faults_are_detected(name, kind, tag, cfg, ranks):
    M, L, mode, kw = cfg
    plan = make(M, L, mode, **kw)
    for rank in ranks or (0, M * L - 1):
        detected, errors = _run_faulty(plan, kind, tag, rank)
        assert detected, f"{name} on rank {rank} went unnoticed"
        assert any(("I1" in e) or ("I2" in e) or ("I3" in e) or ("I4" in e) for e in errors), errors


def test_skipped_zeroing_corrupts_the_executor_result_too():
    """The executor sees the stale partial as well: the landing adds it again."""
    plan = make(2, 8)
    N = 16
    rng = np.random.default_rng(3)
    import ml_dtypes
    shapes = shapes_for(2, 8)
    grads = [[rng.integers(-4, 4, size=s).astype(ml_dtypes.bfloat16) for s in shapes] for _ in range(N)]
    vc = tide.VirtualCluster(tide.Topology(2, 8), check=False)
    good = vc.reduce_scatter(plan, grads)
    # second call with zeroing dropped on every rank, arena holding the first call's partials
    arena = vc.rs_arena(plan)
    seq = vc.session(plan, "reduce_scatter")[0].calls("reduce_scatter") + 1
    bad_sets = {b: _core.build_rs_programs(plan, bank=b) for b in (0, 1)}
    for ps in bad_sets.values():
        for r in range(N):
            while ps.inject_fault(FAULT["skip_zero"], r, 0):
                pass
    outs = [np.zeros(plan.layout.E, np.float32) for _ in range(N)]
    binds = [[(_core.buf_kinds["grad"], p, np.ascontiguousarray(grads[r][p]).reshape(-1).view(np.uint8))
              for p in range(3)] + [(_core.buf_kinds["out"], -1, outs[r].view(np.uint8))] for r in range(N)]
    # poison the inbox like a reused arena would hold it
    for r in range(N):
        arena.fill(r, _core.buf_kinds["inbox"], 0x3F)
    arena.run([[(bad_sets[rs_bank(seq)], seq)] for _ in range(N)], binds)
    assert any(not np.array_equal(a, b) for a, b in zip(good, outs))


def test_rs_staging_stays_flat_while_fsdp2_packing_grows(capsys):
    """Fig. 10b: fixed per-rank output size; RS arena bytes measured by the executor (staging,
    outbox, inbox, spare) from 2 to 8 nodes, next to FSDP2's packed fp32 buffer B_pack."""
    L, E_target = 8, 4096
    rows = []
    for M in (2, 4, 8):
        N = M * L
        sig = tide.GroupSignature(shapes=[(N * E_target // 64, 64)])  # E = 4096 per rank
        measured = {}
        for mode in ("in_place", "slot_reuse"):
            plan = tide.plan(sig, tide.Topology(M, L), mode, k=2, chunk_bytes=1024, n_part=1)
            assert plan.layout.E == E_target
            ps = _core.build_rs_programs(plan)
            arena = _core.CpuArena(N, ps, False)
            K = _core.buf_kinds
            measured[mode] = sum(arena.region_bytes(K[k]) for k in ("staging", "outbox", "inbox", "spare"))
            assert (measured[mode] >= sum(_core.rs_arena_needs(plan)))
        rows.append((M, measured["in_place"], measured["slot_reuse"], plan.layout.B_pack, plan.layout.S_fp32))
    with capsys.disabled():
        print("\nFig. 10b  nodes  RS in-place  RS slot-reuse  FSDP2 B_pack   (units of the fp32 output shard)")
        for M, ip, sr, bp, s in rows:
            print(f"          {M:5d}  {ip / s:11.1f}  {sr / s:13.1f}  {bp / s:12.1f}")
    (_, ip2, sr2, bp2, s), (_, ip8, sr8, bp8, _) = rows[0], rows[-1]
    assert bp8 == 4 * bp2                       # FSDP2: linear in the GPU count
    # TIDE-RS: only the outbox depends on M, and Slot-Reuse bounds it by Eq. 9 (2 banks x 2k).
    assert sr8 - sr2 <= 2 * 2 * 2 * s and sr8 < bp8 / 2
    assert ip8 - ip2 == 2 * (7 - 1) * s            # In-Place: n_out = M - 1 outbox blocks per bank


@pytest.mark.parametrize("M,L,mode,kw", [(2, 8, "in_place", {}), (9, 4, "slot_reuse", {"k": 2, "n_part": 2}),
                                         (3, 4, "in_place", {"chunk_bytes": 16}),
                                         (1, 8, "in_place", {"chunk_bytes": 64}), (1, 8, "slot_reuse", {})])
def test_arena_bytes_measured_by_the_executor(M, L, mode, kw):
    """The executor allocates what the plan says: with the planner's memory model merged,
    bytes per rank equal plan.memory()'s arena; the RS regions always cover what the RS
    programs address (rs_arena_needs, from the RS schedule fields)."""
    plan = make(M, L, mode, **kw)
    N = M * L
    grads = [[np.zeros(s, np.float32) for s in shapes_for(M, L, kw.get("n_part", 1))] for _ in range(N)]
    vc = tide.VirtualCluster(tide.Topology(M, L), check=False)
    vc.reduce_scatter(plan, grads)
    arena = vc.rs_arena(plan)
    K = _core.buf_kinds
    measured = {k: arena.region_bytes(K[k]) for k in ("staging", "outbox", "inbox", "spare")}
    need = dict(zip(("staging", "outbox", "inbox", "spare"), _core.rs_arena_needs(plan)))
    rs = plan.rs_schedule
    assert need["outbox"] == 2 * rs.n_out * rs.block_bytes
    assert need["inbox"] == rs.n_par * L * rs.block_bytes
    assert need["spare"] == 2 * rs.n_spare * rs.block_bytes
    if M == 1:  # [Note: direct Level 1]: staging only
        assert rs.direct and need["outbox"] == need["inbox"] == need["spare"] == 0 and need["staging"] > 0
    assert need["staging"] == rs.n_stg * rs.stg_slot_bytes
    for k in need:
        assert measured[k] >= need[k], k
        if k != "staging":
            assert measured[k] == need[k], k
    if callable(getattr(plan, "memory", None)) and isinstance(plan.memory(), dict):
        mem = plan.memory()
        assert arena.bytes_per_rank == mem["arena_bytes"]
        for k in need:
            assert measured[k] == mem[f"{k}_bytes"], k


def test_rs_at_64_nodes_x_8_runs_exactly():
    """CI scale: 512 ranks, tiny tensors, exact integer sums (the checker at this size is the
    opt-in slow test below)."""
    M, L = 64, 8
    N = M * L
    shapes = [(2 * N + 1, 4), (3,)]
    plan = tide.plan(tide.GroupSignature(shapes=shapes, grad_dtype="float32"), tide.Topology(M, L))
    rng = np.random.default_rng(0)
    grads = [[rng.integers(-3, 3, size=s).astype(np.float32) for s in shapes] for _ in range(N)]
    outs = tide.VirtualCluster(tide.Topology(M, L), check=False, timeout_s=120).reduce_scatter(plan, grads)
    lay = plan.layout
    for p in range(2):
        tot = sum(g[p].astype(np.float64) for g in grads).reshape(-1)
        full = np.zeros(N * lay.params[p].e)
        full[:tot.size] = tot
        e, o = lay.params[p].e, lay.params[p].o32
        for r in range(N):
            assert np.array_equal(outs[r][o:o + e], full[r * e:(r + 1) * e])


@pytest.mark.slow
@pytest.mark.parametrize("M,L", [(64, 8), (128, 1)])
def test_checker_accepts_rs_programs_at_scale(M, L):
    plan = tide.plan(tide.GroupSignature(shapes=[(2 * M * L + 1, 4), (3,)]), tide.Topology(M, L))
    ok, errors = _core.check_calls(calls_for(plan, n_calls=2))
    assert ok, errors


def test_rs_bank_follows_algorithm_1():
    """Every caller picks the bank with tide.plan.rs_bank: b = e mod 2, e = seq - 1 (rs_program.h)."""
    assert [rs_bank(s) for s in (1, 2, 3, 4)] == [0, 1, 0, 1]
    with pytest.raises(tide.PlanError, match="seq=0"):
        rs_bank(0)


@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
@pytest.mark.parametrize("M,L,opts,tag,who,why", [
    (1, 4, dict(chunk_bytes=16, n_stg=1), "StagingWait", range(1, 4), "early staging reuse"),
    (1, 4, dict(chunk_bytes=16), "PushWait", range(4), "missing push fence"),
    (2, 4, dict(chunk_bytes=16, n_stg=1), "StagingWait", range(8), "early staging reuse"),
    (2, 4, dict(chunk_bytes=16), "PushWait", range(8), "missing push fence"),
])
def test_staging_races_are_caught_by_the_executor_canary(M, L, opts, tag, who, why, ranks_as):
    """Defence in depth behind the checker: with the pushers' staging waits (or the owners' push
    waits) dropped and the checker bypassed, the CPU executor's staging canary fails the call
    naming the race, whatever the ranks' timing (a stalled owner makes the race certain), with
    ranks as threads or as processes (the canary's table is shared memory every rank maps)."""
    import ml_dtypes
    plan = make(M, L, **opts)
    assert plan.rs_schedule.n_chunks > 2
    shapes = shapes_for(M, L)
    N = M * L
    rng = np.random.default_rng(5)
    grads = [[rng.integers(-4, 4, size=s).astype(ml_dtypes.bfloat16) for s in shapes] for _ in range(N)]
    bad = programs_without_waits(plan, who, tag)
    vc = tide.VirtualCluster(tide.Topology(M, L), check=False, timeout_s=5.0, ranks_as=ranks_as)
    first_sum = next(i for i, op in enumerate(bad[0].describe(0)) if " SUM " in op)
    outs = [np.zeros(plan.layout.E, np.float32) for _ in range(N)]
    binds = [[(_core.buf_kinds["grad"], p, np.ascontiguousarray(grads[r][p]).reshape(-1).view(np.uint8))
              for p in range(3)] + [(_core.buf_kinds["out"], -1, outs[r].view(np.uint8))] for r in range(N)]
    vc.reduce_scatter(plan, grads)  # seq 1: arena and counters
    arena = vc.rs_arena(plan)
    seq = vc.session(plan, "reduce_scatter")[0].calls("reduce_scatter") + 1
    stall = dict(stall_rank=0, stall_op=first_sum, stall_s=0.3) if tag == "StagingWait" else \
        dict(stall_rank=1, stall_op=0, stall_s=0.3)  # a late pusher: its owners sum too early
    with pytest.raises(_core.Error) as e:
        arena.run([[(bad[rs_bank(seq)], seq)] for _ in range(N)], binds, processes=ranks_as == "processes",
                  **stall)
    msg = str(e.value)
    assert why in msg and "staging-canary" in msg and f"call seq {seq}" in msg, msg
    assert msg.startswith("rank ") and " op " in msg and "staging slot" in msg, msg
