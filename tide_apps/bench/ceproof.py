"""`tide bench ag --ce-proof`: TIDE-AG's transport needs no SMs (paper §3: copy engines).

A spin kernel fills every SM of GPU 0 (grid = #SMs x (max threads per SM / 1024) blocks of 1024
threads, each spinning on %globaltimer for --spin-s seconds, so no other CTA can become
resident). While it runs, one TIDE-AG call starts; the host polls rank 1's landing (on GPU 1)
for rank 0's rows. If they arrive before the spinner ends, GPU 0's data left it without any of
its SMs: the copy engines carried it. The same test on NCCL's all-gather (two spawned processes)
shows rank 0's rows arriving only after the spinner: NCCL's transport runs in CTAs.
With one GPU the test runs with 2 virtual ranks on that GPU and is labelled so (same-GPU copies
may run as driver kernels there, which then wait for the spinner too).
Bounded: the spinner stops by itself after --spin-s; every wait has a deadline.
"""
from __future__ import annotations

import sys
import threading
import time

from tide_apps.bench import common
from tide_apps.bench.common import MIB, progress

_SPIN_SRC = r"""
extern "C" __global__ void tide_spin(unsigned long long dur_ns, unsigned int* started) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (threadIdx.x == 0) atomicAdd(started, 1u);
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < dur_ns);
}
"""


class Spinner:
    """Holds every SM of `device` for `seconds` (cupy RawKernel on a non-blocking stream)."""

    def __init__(self, device: int, seconds: float):
        import cupy
        self.cp, self.device, self.seconds = cupy, device, seconds
        with cupy.cuda.Device(device):
            props = cupy.cuda.runtime.getDeviceProperties(device)
            self.sms = props["multiProcessorCount"]
            self.grid = self.sms * max(1, props["maxThreadsPerMultiProcessor"] // 1024)
            self.kernel = cupy.RawKernel(_SPIN_SRC, "tide_spin")
            self.started = cupy.zeros(1, dtype=cupy.uint32)
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.poll = cupy.cuda.Stream(non_blocking=True)
            self.done = cupy.cuda.Event(disable_timing=True)
            with self.stream:  # compile (nvrtc) and load now, not inside the measured window
                self.kernel((1,), (32,), (cupy.uint64(0), self.started))
            self.stream.synchronize()
            self.started.fill(0)
            cupy.cuda.Device(device).synchronize()

    def start(self, timeout_s: float = 5.0) -> int:
        """Launches the spinner; returns how many of its blocks became resident."""
        cp = self.cp
        with cp.cuda.Device(self.device):
            with self.stream:  # RawKernel launches on the current stream
                self.kernel((self.grid,), (1024,), (cp.uint64(int(self.seconds * 1e9)), self.started))
            self.done.record(self.stream)
            deadline = time.time() + timeout_s
            n = 0
            while time.time() < deadline:
                n = int(cp.asnumpy(self.started, stream=self.poll)[0])
                if n >= self.grid:
                    break
                time.sleep(0.005)
        self.t_start = time.time()
        return n

    def finished(self) -> bool:
        return self.done.done

    def wait(self):
        self.done.synchronize()


def _segments(plan, N, u):
    """(offset, bytes) of rank u's rows of every parameter in a parameter-major landing."""
    lay = plan.layout  # Landing(p, u) = o_p N + u s_p (Eq. 2), from the planner
    return [(lay.landing(p, u), pl.s) for p, pl in enumerate(lay.params)]


def tide_proof(ctx, shard_bytes, spin_s) -> dict:
    import torch

    import tide
    from tide import _core
    N = 2
    devices = [0, 1] if ctx.kind == "multi" else [0]
    sig_shapes = common.group_shapes(shard_bytes, 30, N, 2)
    plan = tide.plan(tide.GroupSignature(shapes=sig_shapes), tide.Topology(1, N))
    vc = tide.VirtualCluster(tide.Topology(1, N), backend="cuda", devices=devices, timeout_s=spin_s + 30)
    g = torch.Generator().manual_seed(7)
    shards = [[torch.randn(-(-D // N), K, generator=g).to(torch.bfloat16).to(f"cuda:{vc.device_of(r)}")
               for D, K in sig_shapes] for r in range(N)]
    _, go, landing = vc.all_gather_runner(plan, shards)
    go()
    ptr1, nbytes1 = landing(1)
    segs = _segments(plan, N, 0)
    dev1 = vc.device_of(1)
    with torch.cuda.device(dev1):  # rank 1's landing is read and poisoned from its own device
        expect = [_core.cuda.d2h(ptr1 + o, n) for o, n in segs]
        _core.cuda.memset(ptr1, 0xFF, nbytes1, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()

    def arrived():
        with torch.cuda.device(dev1):
            return all(_core.cuda.d2h(ptr1 + o, n) == e for (o, n), e in zip(segs, expect))
    if arrived():
        raise RuntimeError("ce-proof: rank 1's landing still holds rank 0's rows after poisoning")
    spin = Spinner(0, spin_s)
    resident = spin.start()
    t0 = time.time()
    go.enqueue()
    t_enq = time.time() - t0
    done = {}
    waiter = threading.Thread(target=lambda: (go.synchronize(), done.setdefault("t", time.time())))
    waiter.start()
    t_arr = t_spin_end = None
    deadline = t0 + spin_s + 20
    while time.time() < deadline and (t_arr is None or t_spin_end is None):
        if t_spin_end is None and spin.finished():
            t_spin_end = time.time()
        if t_arr is None and arrived():
            t_arr = time.time()
        time.sleep(0.002)
    spin.wait()
    waiter.join(timeout=spin_s + 30)
    t_spin_end = t_spin_end or time.time()
    rel = lambda t: None if t is None else t - t0  # noqa: E731
    arrived_under = t_arr is not None and t_arr < t_spin_end - 0.05 * spin_s
    return dict(path="TIDE-AG", devices=devices, spinner_blocks=spin.grid, resident_blocks=resident,
                sms=spin.sms, spin_s=spin_s, enqueue_s=t_enq, arrival_s=rel(t_arr),
                spinner_end_s=rel(t_spin_end), call_done_s=rel(done.get("t")),
                finished_under_spinner=arrived_under)


def _nccl_proof_worker(rank, port, shard_elems, spin_s, spinning, q):
    import os

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    shard = (torch.arange(shard_elems, device=dev) % 251 + 1 + rank).to(torch.bfloat16)
    out = torch.empty(2 * shard_elems, dtype=torch.bfloat16, device=dev)
    dist.all_gather_into_tensor(out, shard)  # warm: communicator and channels set up
    out.view(torch.int16).fill_(-1)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    res = dict(rank=rank)
    if rank == 0:
        spin = Spinner(0, spin_s)
        res["resident_blocks"], res["spinner_blocks"] = spin.start(), spin.grid
        t0 = time.time()
        spinning.set()
        dist.all_gather_into_tensor(out, shard)
        spin.wait()
        res["t_spin_end"] = time.time()
        torch.cuda.synchronize()
        res["t_done"], res["t0"] = time.time(), t0
    else:
        if not spinning.wait(timeout=30):
            res["error"] = "rank 0's spinner never started"
        expect = (torch.arange(shard_elems) % 251 + 1).to(torch.bfloat16)
        dist.all_gather_into_tensor(out, shard)
        side = torch.cuda.Stream()
        deadline = time.time() + spin_s + 20
        while time.time() < deadline:
            with torch.cuda.stream(side):
                got = out[:shard_elems].to("cpu")
            if torch.equal(got.view(torch.int16), expect.view(torch.int16)):
                res["t_arrival"] = time.time()
                break
            time.sleep(0.002)
        torch.cuda.synchronize()
    q.put(res)
    dist.destroy_process_group()


def nccl_proof(shard_bytes, spin_s) -> dict:
    import random

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q, spinning = ctx.Queue(), ctx.Event()
    port = random.randint(20000, 40000)
    procs = [ctx.Process(target=_nccl_proof_worker, args=(r, port, shard_bytes // 2, spin_s, spinning, q))
             for r in range(2)]
    for p in procs:
        p.start()
    got = {r["rank"]: r for r in common.collect(procs, q, 2, spin_s + 120)}
    r0, r1 = got.get(0, {}), got.get(1, {})
    t0 = r0.get("t0")
    rel = lambda k, d: (d[k] - t0) if (t0 is not None and k in d) else None  # noqa: E731
    arr = rel("t_arrival", r1)
    end = rel("t_spin_end", r0)
    return dict(path="NCCL AG", devices=[0, 1], spinner_blocks=r0.get("spinner_blocks"),
                resident_blocks=r0.get("resident_blocks"), spin_s=spin_s, arrival_s=arr,
                spinner_end_s=end, call_done_s=rel("t_done", r0),
                finished_under_spinner=arr is not None and end is not None and arr < end - 0.05 * spin_s,
                error=r1.get("error"))


def main(args) -> int:
    ctx = common.detect_context(args.context if args.context != "cpu" else "auto", 2)
    if ctx.kind == "cpu":
        print("tide bench ag --ce-proof: needs a CUDA GPU (and cupy); nothing to prove on the CPU emulation",
              file=sys.stderr)
        return 2
    import importlib.util
    if importlib.util.find_spec("cupy") is None:  # the spinner is a cupy RawKernel
        print("tide bench ag --ce-proof: needs cupy for the spin kernel (not installed)", file=sys.stderr)
        return 2
    shard = int(float((args.sizes or "8").split(",")[0]) * MIB)
    label = ("2 GPUs: rank 0 on GPU 0, rank 1 on GPU 1" if ctx.kind == "multi"
             else "1 GPU, 2 virtual ranks (same-GPU copies; NOT the 2-GPU proof)")
    print(f"# tide bench ag --ce-proof: {label}; spinner holds every SM of GPU 0 for {args.spin_s:g} s")
    rows = []
    progress("ce-proof: TIDE-AG under the spinner")
    rows.append(tide_proof(ctx, shard, args.spin_s))
    if ctx.kind == "multi":
        progress("ce-proof: NCCL AG under the spinner")
        try:
            rows.append(nccl_proof(shard, args.spin_s))
        except Exception as ex:  # noqa: BLE001 - reported
            rows.append(dict(path="NCCL AG", note=f"failed: {type(ex).__name__}: {ex}"))
    else:
        rows.append(dict(path="NCCL AG", note="not available: needs 2 GPUs"))
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    common.print_table(rows, [("path", "path", 10, str), ("resident_blocks", "resident", 9, "d"),
                              ("spinner_blocks", "of blocks", 9, "d"), ("arrival_s", "rank0 rows at GPU1 (s)", 22, fmt),
                              ("spinner_end_s", "spinner end (s)", 15, fmt), ("call_done_s", "call done (s)", 13, fmt),
                              ("finished_under_spinner", "under spinner", 13, str), ("note", "note", 1, str)])
    t = rows[0]
    verdict = ("PASS" if t.get("finished_under_spinner") else "FAIL") if ctx.kind == "multi" else "INFO"
    print(f"# ce-proof {verdict}: TIDE-AG rank 0 rows reached GPU 1 while every SM of GPU 0 was held: "
          f"{t.get('finished_under_spinner')}")
    result = dict(bench="ag-ce-proof", context=ctx.kind, label=label, rows=rows, verdict=verdict)
    common.write_json(args.json, result)
    if args.plot:
        common.bar_plot(args.plot, f"ce-proof: arrival of rank 0's rows vs spinner end ({label})",
                        {r["path"]: {"arrival": r.get("arrival_s") or 0.0, "spinner end": r.get("spinner_end_s") or 0.0}
                         for r in rows}, "seconds after the call")
    return 0 if verdict != "FAIL" else 1
