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
both RS banks) are bitwise the CPU tide.VirtualCluster's. Run on the GPU machine.
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
        exs = {r: _core.cuda.RankExecutor(fabs[r], r, M, L, regions=cfg["regions"], timeout_s=30.0,
                                          options=dict(rails="two_sided") if rails else None) for r in mine}
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


@pytest.mark.parametrize("M,L", [(2, 2), (1, 4)])
def test_processes_of_several_ranks_match_the_virtual_cluster(M, L):
    if M > 1 and not _core.cuda.nccl_header_version():
        pytest.skip("tide._core was built without NCCL headers (no rails)")
    pytest.importorskip("torch")
    N = M * L
    _, plan = _plan(M, L, False)
    regions, nbytes = _layout(plan)
    seed = int.from_bytes(os.urandom(4), "little") % 100000  # fresh inputs every run
    cfg = dict(M=M, L=L, seed=seed, regions=regions, nbytes=nbytes)
    ctx = mp.get_context("spawn")  # fresh CUDA contexts
    pipes = [ctx.Pipe() for _ in range(N // PER_PROCESS)]
    procs = [ctx.Process(target=_process_main, args=(p, cfg, pipes[p][1]), daemon=True) for p in range(len(pipes))]
    for p in procs:
        p.start()
    conns = [p[0] for p in pipes]
    deadline = time.monotonic() + 240
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
    lands, outs = _reference(M, L, False, seed)
    for r in range(N):
        assert not isinstance(calls[r], str), f"rank {r}:\n{calls[r]}"
        got, stats = calls[r]
        assert [c[0] for c in got] == list(range(1, CALLS + 1)), r
        for seq, land, out in got:
            assert land == lands[seq, r], f"AG landing differs: rank {r} seq {seq}"
            assert out == outs[seq, r], f"RS output differs: rank {r} seq {seq}"
        assert stats == (3, 2 * CALLS), (r, stats)  # one AG set and two RS banks, each prepared once
    assert [p.exitcode for p in procs] == [0] * len(procs), "teardown hung or crashed"
