#!/usr/bin/env python3
"""Where replayed calls (ExecutorOptions.graphs) part from stock FSDP2 on one GPU, world 2.

tests/test_torch_gpu.py's world-2 IPC run with different data per rank, trained step by step
(SGD: stateless, so a step per call is the same training) against stock's shards after every
step, under executor variants side by side:

  eager            the default executor (the reference: the test passes it)
  graphs           ExecutorOptions(graphs=True)
  graphs_sync      graphs, synchronised after every call (sync_every_call): a race between
                   calls disappears, a wrong value does not
  graphs_push      graphs with the all-gather's push landing instead of the pull landing
  graphs_ag_only   graphs, but every reduce-scatter writes a fresh output (then copied back), so
                   its bindings never repeat and it stays eager: only all-gathers replay

One line per variant: the first step whose shards differ, the parameters that differ there and
the largest difference; then handle.stats. A diagnostic (tools/gpu/run.py stage graphdiag), not
a test: it never fails on a difference.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

STEPS = 6
VARIANTS = ("eager", "graphs", "graphs_sync", "graphs_push", "graphs_ag_only")


def _worker(rank, world, variants):
    import torch
    import tide
    import tide_torch
    from tide_torch import comm
    from _torch_dist import batches, build, local_shards, mesh_1d, train
    from test_torch_gpu import _deterministic, _host_comms
    _deterministic()
    device = torch.device("cuda", 0)
    topo = tide.Topology(nodes=1, gpus_per_node=2)
    mesh = mesh_1d("cuda")
    data = batches(STEPS, same_on_all_ranks=False)
    stock = build(mesh=mesh, device=device)
    _host_comms(stock)
    ref = []
    for b in data:
        train(stock, [b], optimizer="sgd", device=device)
        ref.append(local_shards(stock))
    pulls = comm.ExecutorTransport.__dict__["pulls"]  # the staticmethod itself
    reduce_scatter = comm.ExecutorTransport.reduce_scatter
    kept = []  # every fresh output stays alive: no address repeats

    def rs_fresh(self, tg, plan, which, grads, output, alpha):
        fresh = output.clone()
        kept.append(fresh)
        reduce_scatter(self, tg, plan, which, grads, fresh, alpha)
        output.copy_(fresh)
    for v in variants:
        comm.ExecutorTransport.pulls = (staticmethod(lambda plan, post_forward: False)
                                        if v == "graphs_push" else pulls)
        comm.ExecutorTransport.reduce_scatter = rs_fresh if v == "graphs_ag_only" else reduce_scatter
        opts = tide.ExecutorOptions(graphs=v != "eager", sync_every_call=v == "graphs_sync")
        model = build(mesh=mesh, device=device)
        handle = tide_torch.enable(model, mode="in_place", topology=topo, executor_options=opts)
        first = None
        for step, b in enumerate(data):
            train(model, [b], optimizer="sgd", device=device)
            handle.synchronize()
            got = local_shards(model)
            bad = {n: (got[n] - t).abs().max().item() for n, t in ref[step].items()
                   if not torch.equal(got[n], t)}
            if bad and first is None:
                first = (step, bad)
        if rank == 0:
            if first is None:
                verdict = f"bitwise equal to stock after each of {STEPS} steps"
            else:
                step, bad = first
                worst = max(bad, key=bad.get)
                verdict = (f"first differs after step {step}: {len(bad)} params ({', '.join(sorted(bad)[:6])}), "
                           f"max |d| {bad[worst]:.3e} at {worst}")
            print(f"graphdiag {v:12s} {verdict}", flush=True)
            print(f"graphdiag {v:12s} stats {dict(handle.stats)}", flush=True)
        handle.disable()
        del model, handle
    comm.ExecutorTransport.pulls = pulls
    comm.ExecutorTransport.reduce_scatter = reduce_scatter


def main() -> int:
    from _torch_dist import spawn
    variants = tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else VARIANTS
    spawn(_worker, variants, world=2, backend="gloo", cuda_devices=(0, 0), start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
