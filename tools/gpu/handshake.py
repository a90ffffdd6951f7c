"""What one cross-process handshake costs when two processes share one GPU (emulated hosts).

Two processes on GPU 0 ping-pong a counter through their CUDA-IPC arenas, ROUNDS times per
variant, on one torch stream each: round k = [work] + raise my counter to k + wait until the
peer's counter >= k. Variants of the wait:

  memop     cuStreamWaitValue64 (what TIDE's executors issue for WAIT, eager)
  spin      a one-thread kernel polling the peer's counter with __nanosleep (what a replayed
            call's graph wait kernel does)
  nccl      a 1-element all_reduce over NCCL (stock's handshake: one collective)
  none      no handshake: the work alone, both processes at once

``--work-us`` adds a matmul of about that length per round (a module's compute between two
collectives). Prints µs per round per variant (rank 0's wall clock over the rounds, after a
warm-up); the question it answers: does the wait primitive decide what a handshake costs under
time slicing, or the number of handshakes?

  python3 tools/gpu/run.py handshake     (or directly, with the runner's safety variables set)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

SPIN_SRC = r"""
extern "C" __global__ void spin_geq(const volatile unsigned long long* c, unsigned long long v) {
  while (*c < v) { __nanosleep(200); }
}
"""


def _rank(rank: int, args, conn) -> None:
    os.environ.update(NCCL_HOSTID=f"tide-handshake-{rank}", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                      NCCL_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist
    from tide import _core
    torch.cuda.set_device(0)
    fab = _core.cuda.IpcFabric(rank, 2, 0, 1 << 20)
    conn.send(fab.handle())
    fab.open_peers(conn.recv())
    mine, peer = fab.arena_ptr, fab.peer_arena_ptr(1 - rank)
    stream = torch.cuda.Stream()
    sp = stream.cuda_stream
    spin = None
    try:
        import cupy
        spin = cupy.RawKernel(SPIN_SRC, "spin_geq")
        cstream = cupy.cuda.ExternalStream(sp)
    except Exception as e:  # noqa: BLE001 -- the variant is reported as missing
        conn.send(("note", f"spin variant unavailable: {type(e).__name__}: {e}"))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", 0))
    one = torch.ones(1, device="cuda")
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    k = 0
    results = {}
    for work_us in args.work_us:
        reps = 0
        if work_us:  # calibrate: matmuls per round for about work_us
            with torch.cuda.stream(stream):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    a @ a
                torch.cuda.synchronize()
                per = (time.perf_counter() - t) / 20 * 1e6
            reps = max(1, round(work_us / per))
        for variant in ("none", "memop", "spin", "nccl"):
            if variant == "spin" and spin is None:
                continue

            def one_round():
                nonlocal k
                k += 1
                with torch.cuda.stream(stream):
                    for _ in range(reps):
                        a @ a
                    if variant == "memop":
                        _core.cuda.signal(mine, k, sp)
                        _core.cuda.wait([(peer, k)], sp)
                    elif variant == "spin":
                        _core.cuda.signal(mine, k, sp)
                        spin((1,), (1,), (cupy.uint64(peer), cupy.uint64(k)), stream=cstream)
                    elif variant == "nccl":
                        dist.all_reduce(one)

            for _ in range(10):
                one_round()
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.rounds):
                one_round()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t) / args.rounds * 1e6
            results[(work_us, variant)] = (us, reps)
            dist.barrier()
    conn.send(("results", results))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--work-us", default="0,300", help="comma-separated compute per round (µs)")
    ap.add_argument("--port", type=int, default=29531)
    args = ap.parse_args(argv)
    args.work_us = [int(x) for x in args.work_us.split(",")]
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, args, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    handles = [pipes[r][0].recv() for r in range(2)]
    for r in range(2):
        pipes[r][0].send(handles)
    out = {}
    for r in range(2):
        while True:
            if not pipes[r][0].poll(300):
                raise SystemExit(f"rank {r}: no result within 300 s")
            kind, val = pipes[r][0].recv()
            if kind == "note":
                print(f"rank {r}: {val}")
                continue
            out[r] = val
            break
    for p in procs:
        p.join(60)
    print("| work µs (matmuls) | variant | µs per round, rank 0 | rank 1 | minus no-handshake |")
    print("| --- | --- | --- | --- | --- |")
    for (work_us, variant), (us, reps) in out[0].items():
        base = out[0][(work_us, "none")][0]
        print(f"| {work_us} ({reps}) | {variant} | {us:.1f} | {out[1][(work_us, variant)][0]:.1f} | {us - base:+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
