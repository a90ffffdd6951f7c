#!/usr/bin/env python3
"""A/B of the two-sided rail grouping on emulated hosts of one GPU: TIDE-AG at 2 x 1 over an
NcclRail (one NCCL_HOSTID per process, NET/Socket on loopback), the lowered programs with one
rendezvous group per round (head + tail, the default) against one group per PUT, alternating
blocks of calls in the same processes. Prints one 'rails_ab:' line per variant (median and p90
ms per call). Socket-bound: overheads, not bandwidth."""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time

ENV = dict(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="lo")  # (the runner sets the multicast-off variables)
SHAPES = [(512, 256), (1024,)]  # ~0.26 MB per rank, head 64 KiB: latency-bound rounds
BLOCKS, CALLS = 6, 20


def rank_main(rank, conn):
    os.environ.update(ENV, NCCL_HOSTID=f"rails-ab-host-{rank}")
    sys.path.insert(0, "tests")
    import tide
    from tide import _core
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), tide.Topology(2, 1), ag_head_bytes=64 << 10)
    regions, off = {}, 4096
    for n in ["counters", "ring0", "resident", "stage"]:
        nbytes = 8 * 4096 if n == "counters" else plan.region(n)[1]
        regions[n] = (off, nbytes)
        off += (max(nbytes, 1) + 4095) // 4096 * 4096
    fab = _core.cuda.IpcFabric(rank, 2, 0, off)
    fab.open_peers([b"", b""])
    uid = _core.cuda.nccl_unique_id() if rank == 0 else None
    conn.send(uid)
    uid = conn.recv()
    rail = _core.cuda.NcclRail(rank, 2, 0, uid, max_ctas=2)
    ex = _core.cuda.RankExecutor(fab, rank, 2, 1, regions=regions, timeout_s=60, options={"rails": "two_sided"})
    ex.set_rail(rail)
    one = _core.build_ag_programs(plan, arena=regions, landing_region="ring0")
    sets = {"group per round": one.lowered(), "group per PUT": one.lowered(merge_runs=False)}
    times = {k: [] for k in sets}
    seq = 0
    for b in range(BLOCKS):
        for name, ps in (sets.items() if b % 2 == 0 else reversed(list(sets.items()))):
            for _ in range(CALLS):
                seq += 1
                t0 = time.perf_counter()
                ex.run(ps, seq)
                ex.synchronize()
                times[name].append(1e3 * (time.perf_counter() - t0))
    conn.send({k: v[CALLS:] for k, v in times.items()})  # the first block warms up
    conn.recv()
    rail.close()


def main():
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=rank_main, args=(r, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    uid = pipes[0][0].recv()
    pipes[1][0].recv()
    for c, _ in pipes:
        c.send(uid)
    res = [c.recv() for c, _ in pipes]
    for c, _ in pipes:
        c.send("exit")
    for p in procs:
        p.join(60)
    for name in res[0]:
        v = sorted(res[0][name] + res[1][name])
        print(f"rails_ab: {name}: median {statistics.median(v):.3f} ms, p90 {v[int(0.9 * len(v))]:.3f} ms "
              f"over {len(v)} calls (2 ranks)", flush=True)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
