"""RankExecutor: each rank's TIDE-AG / TIDE-RS program run by its own process over every rank's
POSIX shared-memory arena segment, bit-equal to tide.VirtualCluster; dead peers time out, named;
arena-bound programs (caller's region layout, landing region, counter_base)."""
import _posixshmem
import mmap
import multiprocessing as mp
import os
import re
import threading
import time
import traceback
import uuid

import numpy as np
import pytest

import tide
from tide import _core
from tide.plan import rs_bank
from ag_helpers import BF16, SHAPES, make_fulls, make_plan, shard

KIND = dict(_core.buf_kinds)
ALIGN = 256
CALLS = 3
ALPHA = 0.5


def align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_for(plans, counters=3 * 4096, fixed=0):
    """A caller's arena layout (not the planner's order): every region sized for the largest plan,
    plus a 'fixed' region and a counters region for several counter bases."""
    names = ["counters", "inbox", "stage", "ring1", "resident", "outbox", "ring0", "spare", "staging"]
    def nbytes(plan, n):
        try:
            return plan.region(n)[1]
        except _core.Error:  # e.g. no 'resident' with a cast
            return 0

    size = {n: max(nbytes(p, n) for p in plans) for n in names if n != "counters"}
    size["counters"] = 8 * counters
    size["fixed"] = fixed
    regions, off = {}, ALIGN  # leave a gap at the segment start
    for n in names + ["fixed"]:
        regions[n] = (off, size[n])
        off += align(size[n]) + ALIGN
    return regions, off


def ag_inputs(plan, N, seq, cast=False):
    return shard(make_fulls(SHAPES, "int", 100 + seq, np.float32 if cast else BF16), plan, N)


def rs_inputs(plan, N, seq):
    rng = np.random.default_rng(200 + seq)
    lay = plan.layout
    return [[rng.integers(-64, 64, size=lay.params[p].D * lay.params[p].K).astype(BF16) for p in range(lay.P)]
            for _ in range(N)]


def reference(topo, plan, cast=False):
    """Landing bytes and RS outputs per (seq, rank) from tide.VirtualCluster."""
    vc = tide.VirtualCluster(topo)
    N = topo.nodes * topo.gpus_per_node
    lands, outs = {}, {}
    for seq in range(1, CALLS + 1):
        vc.all_gather(plan, ag_inputs(plan, N, seq, cast))
        for r in range(N):
            raw = np.empty(plan.layout.S * N, dtype=np.uint8)
            vc.arena(plan).read(r, KIND["ring0"], 0, raw)
            lands[seq, r] = raw.tobytes()
        res = vc.reduce_scatter(plan, rs_inputs(plan, N, seq), scale=ALPHA)
        for r in range(N):
            outs[seq, r] = res[r].tobytes()
    return lands, outs


def in_threads(n, fn):
    """Runs fn(r) for r in range(n), one thread per rank (in-process ranks); the exceptions raised."""
    errors = []

    def guarded(r):
        try:
            fn(r)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def make_segment(nbytes):
    name = f"/tide_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, nbytes)
        return name, mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def make_rank_plan(M, L, cast):
    return make_plan(M, L, shard_dtype="float32" if cast else None)


def rank_main(rank, M, L, nbytes, regions, names_q, peers_q, barrier, results, dead, timeout_s, fence, cast,
              stop_after_ag=False):
    """One rank: its own segment, its own programs, seq 1..CALLS of AG then RS (stop_after_ag:
    only seq 1's AG, then it stops as if stalled)."""
    name = None
    try:
        topo, plan = make_rank_plan(M, L, cast)
        N = M * L
        name, mm = make_segment(nbytes)
        arena = np.frombuffer(mm, dtype=np.uint8)
        names_q.put((rank, name))
        segments = peers_q.get(timeout=30)
        ex = _core.RankExecutor(rank, M, L, segments, nbytes, regions=regions, timeout_s=timeout_s,
                                fence=fence)
        barrier.wait(timeout=30)  # every rank has mapped every segment: names may go
        _posixshmem.shm_unlink(name)
        name = None
        if dead:
            results.put((rank, "dead", None))
            return
        lay = plan.layout
        ag = _core.build_ag_programs(plan, ring_slot=0, resident=not cast, arena=regions,
                                     landing_region="ring0", landing_offset=0, counter_base=0)
        rs = {b: _core.build_rs_programs(plan, bank=b, alpha=ALPHA, accumulate=False, arena=regions,
                                         counter_base=4096) for b in (0, 1)}
        ring0, resident = regions["ring0"][0], regions["resident"][0]
        for seq in range(1, CALLS + 1):
            shards = [np.ascontiguousarray(x) for x in ag_inputs(plan, N, seq, cast)[rank]]
            if not cast:  # in-place adoption: the shards live in the resident region
                for p, x in enumerate(shards):
                    b = x.view(np.uint8).reshape(-1)
                    arena[resident + lay.params[p].o: resident + lay.params[p].o + b.size] = b
            ag_binds = [(KIND["shard"], p, x.ctypes.data, x.nbytes) for p, x in enumerate(shards)] if cast else []
            t0 = time.monotonic()
            try:
                ex.run(ag, seq, ag_binds)
            except tide.TimeoutError as e:
                results.put((rank, "timeout", (str(e), time.monotonic() - t0)))
                return
            land = arena[ring0: ring0 + lay.S * N].tobytes()
            if stop_after_ag:
                results.put((rank, "dead", None))
                return
            grads = [np.ascontiguousarray(g) for g in rs_inputs(plan, N, seq)[rank]]
            out = np.full(lay.E, np.nan, dtype=np.float32)
            binds = [(KIND["grad"], p, g.ctypes.data, g.nbytes) for p, g in enumerate(grads)]
            binds.append((KIND["out"], -1, out.ctypes.data, out.nbytes))
            t0 = time.monotonic()
            try:
                ex.run(rs[rs_bank(seq)], seq, binds)
            except tide.TimeoutError as e:
                results.put((rank, "timeout", (str(e), time.monotonic() - t0)))
                return
            results.put((rank, "call", (seq, land, out.tobytes())))
        results.put((rank, "done", None))
    except BaseException:  # noqa: BLE001 - report to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if name is not None:
            _posixshmem.shm_unlink(name)


def run_ranks(M, L, dead_rank=-1, timeout_s=10.0, fence=True, cast=False, stall_rank=-1):
    topo, plan = make_rank_plan(M, L, cast)
    N = M * L
    regions, nbytes = layout_for([plan])
    # forkserver: ranks start from a clean single-threaded server, never forked from this
    # (possibly multi-threaded: JAX, torch) test process, where fork() can deadlock the child.
    ctx = mp.get_context("forkserver")
    names_q, results = ctx.Queue(), ctx.Queue()
    peers_qs = [ctx.Queue() for _ in range(N)]
    barrier = ctx.Barrier(N)
    procs = [ctx.Process(target=rank_main, args=(r, M, L, nbytes, regions, names_q, peers_qs[r], barrier,
                                                 results, r == dead_rank, timeout_s, fence, cast, r == stall_rank))
             for r in range(N)]
    for p in procs:
        p.start()
    names = dict(names_q.get(timeout=30) for _ in range(N))
    segments = [names[r] for r in range(N)]
    for q in peers_qs:
        q.put(segments)
    got, finished = [], 0
    deadline = time.monotonic() + 60
    while finished < N and time.monotonic() < deadline:
        item = results.get(timeout=max(0.1, deadline - time.monotonic()))
        got.append(item)
        if item[1] != "call":
            finished += 1
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    assert finished == N, f"ranks hung: {got}"
    errors = [g for g in got if g[1] == "error"]
    assert not errors, errors[0][2]
    leaked = [s for s in segments if os.path.exists("/dev/shm" + s)]
    assert not leaked
    return topo, plan, got


@pytest.mark.parametrize("M,L,cast", [(2, 2, False), (4, 1, False), (2, 2, True)])
def test_ranks_as_processes_match_the_virtual_cluster(M, L, cast):
    topo, plan, got = run_ranks(M, L, cast=cast)
    lands, outs = reference(topo, plan, cast)
    calls = [g for g in got if g[1] == "call"]
    assert len(calls) == M * L * CALLS
    for rank, _, (seq, land, out) in calls:
        assert land == lands[seq, rank], f"AG landing differs: rank {rank} seq {seq}"
        assert out == outs[seq, rank], f"RS output differs: rank {rank} seq {seq}"


@pytest.mark.parametrize("fence", [True, False])
def test_dead_peer_times_out_naming_rank_op_seq(fence):
    _, _, got = run_ranks(2, 2, dead_rank=3, timeout_s=1.0, fence=fence)
    timeouts = [g for g in got if g[1] == "timeout"]
    assert sorted(g[0] for g in timeouts) == [0, 1, 2]
    named_dead = 0
    for rank, _, (msg, waited) in timeouts:
        assert waited < 10
        assert msg.startswith(f"TIDE timeout after 1 s: rank {rank} (node ") and "call seq 1 group 0: " in msg
        if fence and "entry fence" in msg:
            assert "waits for rank 3 to start run #1" in msg
        else:
            assert re.search(r"op \d+ (WAIT|EVENT_WAIT) \[stream \w+\]", msg), msg
        named_dead += "rank 3" in msg
    assert named_dead >= 1  # the chain leads to the dead rank


def test_a_reduce_scatter_fences_on_the_peers_previous_run_only():
    """[Note: entry fence]: TIDE-AG lands in the peers' ring slots, so it waits for their arrival;
    TIDE-RS writes only their scratch, so it waits for their previous run to finish, never for
    their caller to reach the call. Rank 3 finishes its seq-1 AG (run #1) and stalls before its
    RS (run #2): every other rank's RS gets past the fence (rank 3 finished run #1) and times out
    on the data it needs from rank 3, naming it; rank 3's AG pushes and its landing are intact."""
    _, _, got = run_ranks(2, 2, timeout_s=1.0, stall_rank=3)
    timeouts = {g[0]: g[2][0] for g in got if g[1] == "timeout"}
    assert sorted(timeouts) == [0, 1, 2], got
    for rank, msg in timeouts.items():
        assert "call seq 1" in msg and "entry fence" not in msg, msg
        assert re.search(r"op \d+ (WAIT|EVENT_WAIT) \[stream \w+\]", msg), msg
    assert any("rank 3" in m for m in timeouts.values()), timeouts
    _, _, got = run_ranks(2, 2, timeout_s=1.0, dead_rank=3)  # no AG at all: the AG's fence names it
    fenced = [g[2][0] for g in got if g[1] == "timeout" and "entry fence" in g[2][0]]
    assert fenced and all("waits for rank 3 to start run #1 (it has started no run)" in m for m in fenced), got


def test_two_groups_share_one_counters_region_in_process():
    """Address-mode RankExecutors (one per rank, threads): two AG groups with different plans and
    counter bases, one landing in ring0, one in 'fixed' at an offset with its adopted shards at
    resident_offset, interleaved over three calls; then the bases swapped onto one region."""
    M, L = 2, 2
    N = M * L
    topo, plan_a = make_plan(M, L)
    shapes_b = [(9, 4), (3,)]
    _, plan_b = make_plan(M, L, shapes=shapes_b)
    NSb = plan_b.layout.S * N
    regions, nbytes = layout_for([plan_a, plan_b], counters=2 * 4096, fixed=ALIGN + NSb)
    # room in 'resident' for both groups: a's shards at 0, b's after them
    res_b = align(plan_a.layout.S)
    regions["resident"] = (regions["resident"][0], res_b + plan_b.layout.S)
    arenas = [np.zeros(nbytes + 2 * ALIGN + res_b, dtype=np.uint8) for _ in range(N)]
    addrs = [a.ctypes.data for a in arenas]
    exs = [_core.RankExecutor(r, M, L, addrs, nbytes + 2 * ALIGN + res_b, regions=regions, timeout_s=10)
           for r in range(N)]
    fixed_off = ALIGN
    ag_a = _core.build_ag_programs(plan_a, ring_slot=0, arena=regions, landing_region="ring0", counter_base=0)
    ag_b = _core.build_ag_programs(plan_b, ring_slot=1, arena=regions, landing_region="fixed",
                                   landing_offset=fixed_off, resident_offset=res_b, counter_base=4096)
    assert ag_a.arena_bound and ag_b.arena_bound
    vc = tide.VirtualCluster(topo)
    for seq in range(1, CALLS + 1):
        ins = {"a": shard(make_fulls(SHAPES, "int", seq), plan_a, N),
               "b": shard(make_fulls(shapes_b, "int", 50 + seq), plan_b, N)}
        for r in range(N):
            for key, plan, extra in (("a", plan_a, 0), ("b", plan_b, res_b)):
                for p, x in enumerate(ins[key][r]):
                    b = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
                    o = regions["resident"][0] + extra + plan.layout.params[p].o
                    arenas[r][o: o + b.size] = b

        def rank_calls(r):
            exs[r].run(ag_a, seq, [])
            exs[r].run(ag_b, seq, [])

        errors = in_threads(N, rank_calls)
        assert not errors, errors
        for key, plan, kind, off in (("a", plan_a, "ring0", regions["ring0"][0]),
                                     ("b", plan_b, "ring1", regions["fixed"][0] + fixed_off)):
            vc.all_gather(plan, ins[key], ring_slot=1 if key == "b" else 0)
            NS = plan.layout.S * N
            for r in range(N):
                raw = np.empty(NS, dtype=np.uint8)
                vc.arena(plan).read(r, KIND[kind], 0, raw)
                assert arenas[r][off: off + NS].tobytes() == raw.tobytes(), (key, seq, r)
    # Both groups' counters sit in the one region: a's from 0, b's from 4096.
    cnt = regions["counters"][0]
    c = arenas[0][cnt: cnt + 8 * 2 * 4096].view(np.uint64)
    assert c[:4096].any() and c[4096:].any()


def test_missing_region_is_named():
    M, L = 2, 1
    topo, plan = make_plan(M, L)
    regions, nbytes = layout_for([plan])
    del regions["stage"]
    arenas = [np.zeros(nbytes, dtype=np.uint8) for _ in range(2)]
    ex = _core.RankExecutor(0, M, L, [a.ctypes.data for a in arenas], nbytes, regions=regions, timeout_s=1)
    progs = _core.build_ag_programs(plan)
    with pytest.raises(_core.Error, match="uses arena region 'stage'"):
        ex.run(progs, 1, [])
    bound = _core.build_ag_programs(plan, arena=regions)
    with pytest.raises(_core.Error, match="uses arena region 'stage'"):
        ex.run(bound, 1, [])
    small = dict(regions, stage=(regions["inbox"][0], 16))
    with pytest.raises(_core.Error, match=r"addresses \d+ bytes of arena region 'stage', which has 16"):
        ex.run(_core.build_ag_programs(plan, arena=small), 1, [])
    other = dict(regions, stage=(regions["inbox"][0], 1 << 16),
                 counters=(regions["counters"][0], regions["counters"][1] // 2))
    with pytest.raises(_core.PlanError, match="bound to a 'counters' region"):
        ex.run(_core.build_ag_programs(plan, arena=other), 1, [])
    with pytest.raises(_core.PlanError, match="region 'nowhere' is not in arena"):
        _core.build_ag_programs(plan, arena=regions, landing_region="nowhere")
    with pytest.raises(_core.Error, match="cannot open rank 0's arena segment '/tide_no_such'"):
        _core.RankExecutor(1, M, L, ["/tide_no_such", "/tide_no_such2"], nbytes, regions=regions)


def test_counter_base_without_arena_keeps_the_virtual_cluster_working():
    topo, plan = make_plan(2, 2)
    progs = _core.build_ag_programs(plan, counter_base=100)
    assert progs.num_counters == 100 + _core.build_ag_programs(plan).num_counters
    ok, errors = progs.check(2)
    assert ok, errors


def test_sub_groups_run_with_ranks():
    """HSDP: shard groups {0, 2} and {1, 3} of a 2 x 2 world each run a 2 x 1 plan (ranks=)."""
    M, L, N = 2, 2, 4
    topo_g, plan = make_plan(2, 1)
    regions, nbytes = layout_for([plan])
    arenas = [np.zeros(nbytes, dtype=np.uint8) for _ in range(N)]
    exs = [_core.RankExecutor(r, M, L, [a.ctypes.data for a in arenas], nbytes, regions=regions, timeout_s=10)
           for r in range(N)]
    ag = _core.build_ag_programs(plan, resident=False, arena=regions)
    groups = [[0, 2], [1, 3]]
    ins = {g: shard(make_fulls(SHAPES, "int", 7 + g), plan, 2) for g in range(2)}

    def rank_calls(r):
        g = r % 2
        mine = [np.ascontiguousarray(x) for x in ins[g][groups[g].index(r)]]
        exs[r].run(ag, 1, [(KIND["shard"], p, x.ctypes.data, x.nbytes) for p, x in enumerate(mine)],
                   ranks=groups[g])

    errors = in_threads(N, rank_calls)
    assert not errors, errors
    NS, ring0 = plan.layout.S * 2, regions["ring0"][0]
    for g in range(2):
        vc = tide.VirtualCluster(topo_g)
        vc.all_gather(plan, ins[g], resident=False)
        for i, r in enumerate(groups[g]):
            raw = np.empty(NS, dtype=np.uint8)
            vc.arena(plan).read(i, KIND["ring0"], 0, raw)
            assert arenas[r][ring0: ring0 + NS].tobytes() == raw.tobytes(), (g, r)
    with pytest.raises(_core.PlanError, match="pass ranks= for a sub-group"):
        exs[0].run(ag, 2, [])
    with pytest.raises(_core.PlanError, match="rank 0 is not in ranks"):
        exs[0].run(ag, 2, [], ranks=[1, 3])
