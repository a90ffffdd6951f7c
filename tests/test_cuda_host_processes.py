"""Processes that each hold several ranks of a topology node on CUDA (one JAX process per host),
on the core's path: 2 spawned processes x 2 in-process ranks on GPU 0. Each rank has its own
IpcFabric, RankExecutor, caller stream and thread (as XLA's device threads); a peer of the same
process is opened by pointer ([Note: same-process peers] in csrc/fabric/ipc.h), one of the other
process by CUDA IPC, another node over the rank's NCCL rail.

- 2 x 2, each process a node and an emulated host (its own NCCL_HOSTID, NCCL over loopback): the
  node's peers by pointer only, the other node over two rails per process (one per local index,
  joined in rail order).
- 1 x 4: the node spans both processes: peers by pointer inside a process, by IPC across.

TIDE-AG landings and TIDE-RS outputs of 3 calls (fresh integer-valued inputs, poisoned outputs,
both RS banks) are bitwise the CPU tide.VirtualCluster's, and both processes exit 0 (teardown).
The ranks of a process take turns enqueueing ([Note: same-process issue gate], fabric/fabric.h);
the 2 x 2 shape also runs with every stream of a process in one hardware queue
(CUDA_DEVICE_MAX_CONNECTIONS=1), where an interleaving outside the global order blocks for good.
run_shape() is the driver; tools/gpu/host_processes_diag.py runs it in variants. Run on the GPU
machine.
"""
import faulthandler
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import pytest

from tide import _core
from test_cuda_ipc import CALLS, RAIL_ENV, _layout, _plan, _reference, reaped, torch_stream_calls

pytestmark = pytest.mark.gpu
PER_PROCESS = 2


def _rank_calls(rank, cfg, fab, ex, plan, out):
    """Rank `rank`'s CALLS calls on its own torch stream (the torch mode of tests/test_cuda_ipc.py)."""
    try:
        import torch
        calls = list(torch_stream_calls(rank, cfg, fab, ex, plan, torch.device("cuda", 0), lowered=cfg["M"] > 1))
        out[rank] = (calls, (ex.cached_program_sets, ex.runs_started))
    except BaseException:  # noqa: BLE001 - reported by the process
        out[rank] = traceback.format_exc()


def _process_main(p, cfg, conn):
    os.environ.update(cfg.get("env") or {})  # before this process's CUDA context exists
    # A native abort (teardown) names its Python and native frames in the test's report.
    _core.cuda.install_stack_dump(signal.SIGABRT)
    faulthandler.enable(all_threads=True)  # first: Python's stacks, then the native dump above
    try:
        M, L = cfg["M"], cfg["L"]
        N, rails = M * L, M > 1
        if rails:  # an emulated host: its own NCCL_HOSTID, NCCL's network transport on loopback
            os.environ.update(RAIL_ENV, NCCL_HOSTID=f"tide-emulated-host-{p}")
        _, plan = _plan(M, L, False)
        mine = range(p * PER_PROCESS, (p + 1) * PER_PROCESS)
        fabs = {r: _core.cuda.IpcFabric(r, N, 0, cfg["nbytes"]) for r in mine}
        ids = {r: _core.cuda.nccl_unique_id() for r in mine if rails and r < L}  # node 0 names each rail
        conn.send(("handles", ({r: f.handle() for r, f in fabs.items()}, ids)))
        handles, rail_ids = conn.recv()
        same = [fabs.get(q) for q in range(N)]
        for r, f in fabs.items():  # this node's ranks of the other process by IPC, of this one by pointer
            f.open_peers([h if q // L == r // L and q not in fabs else b"" for q, h in enumerate(handles)],
                         same_process=same)
            assert [bool(f.peer_arena_ptr(q)) for q in range(N)] == [q // L == r // L for q in range(N)]
            assert all(f.peer_arena_ptr(q) == g.arena_ptr for q, g in fabs.items())
        options = dict(cfg.get("options") or {}, **(dict(rails="two_sided") if rails else {}))
        exs = {r: _core.cuda.RankExecutor(fabs[r], r, M, L, regions=cfg["regions"], timeout_s=cfg["timeout_s"],
                                          options=options or None) for r in mine}
        nccl = {}
        for r in mine:  # rail order (local index) on every process: no process waits on a later rail
            if rails:
                nccl[r] = _core.cuda.NcclRail(r // L, M, 0, rail_ids[r % L], max_ctas=2)
                exs[r].set_rail(nccl[r])
        conn.send(("open", None))
        conn.recv()  # every rank of both processes has opened its peers
        out = {}
        threads = [threading.Thread(target=_rank_calls, args=(r, cfg, fabs[r], exs[r], plan, out)) for r in mine]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        conn.send(("calls", {r: out.get(r, "the rank's thread did not finish in 120 s") for r in mine}))
        conn.recv()  # teardown barrier: the other process may read these arenas until it is done
        exs.clear()
        for rail in nccl.values():
            if not rail.aborted:
                rail.close()
        fabs.clear()
    except BaseException:  # noqa: BLE001 - report to the parent
        conn.send(("error", traceback.format_exc()))


def _expect(conns, kind, deadline):
    got = {}
    for i, c in enumerate(conns):
        assert c.poll(max(0.0, deadline - time.monotonic())), f"process {i} sent no {kind!r} in time"
        tag, val = c.recv()
        assert tag == kind, f"process {i}: {tag}: {val}"
        got[i] = val
    return got


def run_shape(M, L, *, options=None, timeout_s=30.0, env=None, budget_s=240.0):
    """M x L ranks in N / PER_PROCESS spawned processes of PER_PROCESS ranks each. options: the
    executors' (rails added), env: set in each process before CUDA starts. Returns (seed, calls
    {rank: [(seq, landing, output)] or the rank's error text}, exit codes, the driver's error or
    None: a process that failed outside its calls or sent nothing within budget_s)."""
    N = M * L
    _, plan = _plan(M, L, False)
    regions, nbytes = _layout(plan)
    seed = int.from_bytes(os.urandom(4), "little") % 100000  # fresh inputs every run
    cfg = dict(M=M, L=L, seed=seed, regions=regions, nbytes=nbytes, options=options, timeout_s=timeout_s, env=env)
    ctx = mp.get_context("spawn")  # fresh CUDA contexts
    pipes = [ctx.Pipe() for _ in range(N // PER_PROCESS)]
    procs = [ctx.Process(target=_process_main, args=(p, cfg, pipes[p][1]), daemon=True) for p in range(len(pipes))]
    for p in procs:
        p.start()
    conns = [p[0] for p in pipes]
    deadline = time.monotonic() + budget_s
    calls, error = {}, None
    try:
        with reaped(procs):
            sent = _expect(conns, "handles", deadline)
            handles = [h for p in sorted(sent) for _, h in sorted(sent[p][0].items())]
            ids = {r: i for p in sent.values() for r, i in p[1].items()}
            for c in conns:
                c.send((handles, [ids[r] for r in range(L)] if M > 1 else None))
            _expect(conns, "open", deadline)
            for c in conns:
                c.send("go")
            calls = {r: v for p in _expect(conns, "calls", deadline).values() for r, v in p.items()}
            for c in conns:
                c.send("exit")
    except AssertionError as e:  # a process sent an error, or nothing in time (the processes are killed)
        error = str(e)
    return seed, calls, [p.exitcode for p in procs], error


def problems(M, L, seed, calls):
    """What differs from the CPU virtual cluster, per rank (empty: bitwise equal, every call)."""
    lands, outs = _reference(M, L, False, seed)
    out = []
    for r in range(M * L):
        if r not in calls:
            out.append(f"rank {r}: no result")
            continue
        if isinstance(calls[r], str):
            out.append(f"rank {r}:\n{calls[r]}")
            continue
        got, stats = calls[r]
        if [c[0] for c in got] != list(range(1, CALLS + 1)):
            out.append(f"rank {r}: calls {[c[0] for c in got]}")
        for seq, land, res in got:
            if land != lands[seq, r]:
                out.append(f"AG landing differs: rank {r} seq {seq}")
            if res != outs[seq, r]:
                out.append(f"RS output differs: rank {r} seq {seq}")
        if stats != (3, 2 * CALLS):  # one AG set and two RS banks, each prepared once
            out.append(f"rank {r}: stats {stats}")
    return out


def _check(M, L, **kw):
    seed, calls, codes, error = run_shape(M, L, **kw)
    assert error is None, error
    bad = problems(M, L, seed, calls)
    assert not bad, "\n".join(bad)
    assert codes == [0] * len(codes), f"teardown hung or crashed: exit codes {codes}"


@pytest.mark.parametrize("M,L", [(2, 2), (1, 4)])
def test_processes_of_several_ranks_match_the_virtual_cluster(M, L):
    if M > 1 and not _core.cuda.nccl_header_version():
        pytest.skip("tide._core was built without NCCL headers (no rails)")
    pytest.importorskip("torch")
    _check(M, L)


def test_two_sided_rails_on_torch_streams_match_the_virtual_cluster():
    """The 2 x 2 shape with every stream of a process in one hardware queue: a wait enqueued
    ahead of its producer blocks that queue for good, so only the one global order passes."""
    if not _core.cuda.nccl_header_version():
        pytest.skip("tide._core was built without NCCL headers (no rails)")
    pytest.importorskip("torch")
    _check(2, 2, env=dict(CUDA_DEVICE_MAX_CONNECTIONS="1"), timeout_s=20.0, budget_s=120.0)
