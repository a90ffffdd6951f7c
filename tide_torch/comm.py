"""The one place where tide_torch moves bytes between ranks: calls into TIDE's executors.

The adapter hands the transport per-parameter tensors whose addresses the plan fixed:

- ``all_gather(tg, inputs, landings)``: ``inputs[p]`` is this rank's padded shard of parameter
  p: the adopted resident shard (read in place), or the fp32 master shard that the transport
  casts into the group's receive-stage slot (mixed precision). ``landings[p]`` is the padded
  unsharded buffer (``N * e_p`` items at arena offset ``landing(p, 0)``). Afterwards every rank's
  shard r of p sits at ``landing(p, r)`` (Eq. 2): no copy-out.
- ``reduce_scatter(tg, plan, grads, output, alpha)``: ``grads[p]`` is parameter p's unpadded
  gradient (autograd's tensor for In-Place, the vacated ring slot for Slot-Reuse) in ``plan``'s
  gradient dtype (the group's plan, or its fp32-gradient plan); ``output`` is FSDP2's
  fp32 reduce-scatter output, whose ``as_strided`` views at ``o32_p`` are the sharded grads.
  ``output = alpha * sum_r grads_r`` over this rank's rows, padding rows contributing zero.

Executors
  TIDE's CPU executor runs ranks as processes over POSIX shared memory: each rank's arena is a
  named segment (``Arena.shm_name``, exchanged at enable time), a rank reads only its own buffers
  and pushes into peers' arenas. ``ExecutorTransport`` ("auto"/"executor", the default on CPU)
  runs this rank's compiled TIDE-AG / TIDE-RS program through ``tide._core.RankExecutor``.
  On CUDA, ``CudaExecutorTransport`` ("auto"/"executor" when tide._core has ``CudaRankExecutor``
  and the arena sits on a fabric: ``CudaIpcFabric``, or ``NcclFabric`` with
  ``enable(fabric="nccl")``) runs the same programs on the GPU, enqueued on the caller's current
  stream.

  Two stand-ins remain for comparison and debugging; neither is TIDE's transport (bytes cross
  torch.distributed) and both log so once:

  - ``VirtualClusterTransport`` ("virtual-cluster"): runs the real TIDE-AG / TIDE-RS programs on
    ``tide.VirtualCluster`` in the shard group's first rank, which gathers the group's inputs and
    hands every rank its bytes back over torch.distributed.
  - ``InterimTransport`` ("interim"): per-parameter torch.distributed collectives with the
    adapter's addressing. Also what a CUDA run uses on a build without the CUDA-IPC fabric.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist

import tide
from tide.plan import rs_bank

logger = logging.getLogger("tide_torch")


class Transport(Protocol):
    name: str

    def all_gather(self, tg: Any, inputs: list[torch.Tensor],
                   landings: list[torch.Tensor]) -> None: ...

    def reduce_scatter(self, tg: Any, plan: Any, grads: list[torch.Tensor], output: torch.Tensor,
                       alpha: float) -> None: ...


def _executor_api() -> Any | None:
    """TIDE's per-rank process-mode executor binding, when this build of tide._core has one."""
    return getattr(tide._core, "RankExecutor", None)


class ExecutorTransport:
    """Runs TIDE-AG / TIDE-RS programs through TIDE's CPU executor with ranks as processes.

    Written against the executor entry points tide_torch needs (not in tide._core yet; see the
    merge notes): every rank's arena is its own POSIX segment (``Arena``, names exchanged at
    enable time); ``RankExecutor`` maps all of them, reads only its own rank's buffers and
    pushes into peers' arenas, and runs only its own rank's program per call:

        ex = tide._core.RankExecutor(rank, nodes, gpus_per_node, segments, segment_bytes,
                                     regions={name: (offset, nbytes)}, timeout_s=30.0)
        progs = tide._core.build_ag_programs(plan, ring_slot=s, resident=adopt,
                                             arena=regions, landing_region="ring0|ring1|fixed",
                                             landing_offset=off, counter_base=c)
        progs = tide._core.build_rs_programs(plan, bank=b, alpha=a, accumulate=False,
                                             arena=regions, counter_base=c)
        ex.run(progs, seq, [(kind, index, data_ptr, nbytes), ...])   # kShard/kGrad/kOut
    """

    name = "tide-executor"

    def __init__(self, api: Any, arena: Any, peers: list[str], rank: int, topo: tide.Topology,
                 group_of: Any = None):
        self._regions = {r.name: (r.offset, r.nbytes) for r in arena.regions.values()}
        self._exec = self._make_executor(api, arena, peers, rank, topo)
        self._programs: dict[tuple, Any] = {}
        self._seq: dict[tuple[int, str], int] = {}
        self._kind = dict(tide._core.buf_kinds)
        self._group_of = group_of
        self._world = topo.nodes * topo.gpus_per_node
        self._ranks: dict[int, Any] = {}

    def _make_executor(self, api, arena, peers, rank, topo):
        return api(rank, topo.nodes, topo.gpus_per_node, peers, arena.nbytes,
                   regions=self._regions)

    def _run(self, progs: Any, seq: int, bindings: list, ranks: Any) -> None:
        self._exec.run(progs, seq, bindings, ranks=ranks)

    def _ranks_of(self, tg: Any) -> Any:
        """The shard group's global ranks when it is a sub-group (HSDP), else None."""
        if tg.index not in self._ranks:
            ranks = None
            if self._group_of is not None:
                ranks = dist.get_process_group_ranks(self._group_of(tg))
                ranks = None if list(ranks) == list(range(self._world)) else list(ranks)
            self._ranks[tg.index] = ranks
        return self._ranks[tg.index]

    def _next_seq(self, tg: Any, what: str) -> int:
        key = (tg.index, what)
        self._seq[key] = self._seq.get(key, 0) + 1
        return self._seq[key]

    def _counter_base(self, tg: Any, what: str) -> int:
        return (3 * tg.index + {"ag": 0, "rs": 1, "rs32": 2}[what]) * 4096

    def all_gather(self, tg, inputs, landings):
        seq = self._next_seq(tg, "ag")
        ring = tg.ring_index % 2 if tg.ring_index >= 0 else 0
        key = ("ag", tg.index)
        if key not in self._programs:
            region = self._regions[tg.slot]
            self._programs[key] = tide._core.build_ag_programs(
                tg.plan, ring_slot=ring, resident=tg.adopts, arena=self._regions,
                landing_region=tg.slot, landing_offset=tg.unsharded_offset - region[0],
                resident_offset=tg.resident_offset - self._regions["resident"][0] if tg.adopts else 0,
                counter_base=self._counter_base(tg, "ag"))
        bindings = [] if tg.adopts else [
            (self._kind["shard"], p, t.data_ptr(), t.numel() * t.element_size())
            for p, t in enumerate(inputs)]
        self._run(self._programs[key], seq, bindings, self._ranks_of(tg))

    def reduce_scatter(self, tg, plan, grads, output, alpha):
        what = "rs" if plan is tg.plan else "rs32"
        seq = self._next_seq(tg, what)
        bank = rs_bank(seq)
        key = ("rs", tg.index, plan.hash, bank, float(alpha))
        if key not in self._programs:
            self._programs[key] = tide._core.build_rs_programs(
                plan, bank=bank, alpha=float(alpha), accumulate=False, arena=self._regions,
                counter_base=self._counter_base(tg, what))
        bindings = [(self._kind["grad"], p, g.data_ptr(), g.numel() * g.element_size())
                    for p, g in enumerate(grads)]
        bindings.append((self._kind["out"], -1, output.data_ptr(),
                         output.numel() * output.element_size()))
        self._run(self._programs[key], seq, bindings, self._ranks_of(tg))


def _cuda_executor_api() -> Any | None:
    """TIDE's per-rank CUDA executor binding, when this build of tide._core has one."""
    return getattr(tide._core, "CudaRankExecutor", None)


def cuda_executor_available() -> bool:
    """Whether this build can run TIDE's programs on CUDA ranks (executor + CUDA-IPC fabric)."""
    return (_cuda_executor_api() is not None and getattr(tide._core, "CudaIpcFabric", None)
            is not None and bool(tide._core.cuda_available()))


class CudaExecutorTransport(ExecutorTransport):
    """TIDE-AG / TIDE-RS programs through ``tide._core.CudaRankExecutor`` over the fabric of the
    ranks' arenas (``Arena.fabric``: a ``CudaIpcFabric`` whose handles were exchanged and opened
    at enable time, or an ``NcclFabric``, which maps its LSA peers itself).

    Same program building, counter bases and per-group sequence numbers as the CPU executor.
    Each call is enqueue-only on the caller's current stream (FSDP2's all-gather stream or
    reduce-scatter stream): the program's stream 0 waits for that stream's prior work and the
    stream waits for the program's completion, so there is no host synchronisation per call and
    FSDP2's own events order everything around it. Errors (a peer's timeout names rank, op and
    seq) surface from the call that detects them or from ``synchronize()``."""

    name = "tide-cuda-executor"

    def __init__(self, api: Any, arena: Any, rank: int, topo: tide.Topology,
                 group_of: Any = None, **knobs: Any):
        self._knobs = knobs  # sum_ctas / land_ctas / timeout_s
        super().__init__(api, arena, [], rank, topo, group_of)

    def _make_executor(self, api, arena, peers, rank, topo):
        return api(arena.fabric, rank, topo.nodes, topo.gpus_per_node, regions=self._regions,
                   **self._knobs)

    def _run(self, progs, seq, bindings, ranks):
        stream = torch.cuda.current_stream().cuda_stream
        self._exec.run(progs, seq, bindings, stream=stream, ranks=ranks)

    def synchronize(self) -> None:
        self._exec.synchronize()


class InterimTransport:
    """Stand-in for the executor: per-parameter torch.distributed collectives with the adapter's
    addressing (lands directly; reduces each parameter into its slice of FSDP2's output)."""

    name = "interim-torch-distributed"

    def __init__(self, group_of: Any):
        self._group_of = group_of  # tg -> shard ProcessGroup

    def all_gather(self, tg, inputs, landings):
        group = self._group_of(tg)
        if tg.casts:  # the CAST into the receive-stage slot (stage parity: see placement.py)
            torch._foreach_copy_(tg.input_views, inputs)
            inputs = tg.input_views
        for inp, out in zip(inputs, landings):
            dist.all_gather_into_tensor(out, inp, group=group)

    def reduce_scatter(self, tg, plan, grads, output, alpha):
        group = self._group_of(tg)
        layout = plan.layout
        N = layout.N
        for p, grad in enumerate(grads):
            pl = layout.params[p]
            full = torch.zeros(N * pl.e, dtype=output.dtype, device=output.device)
            full[: grad.numel()].copy_(grad.reshape(-1))
            dist.reduce_scatter_tensor(output.narrow(0, pl.o32, pl.e), full,
                                       op=dist.ReduceOp.SUM, group=group)
        if alpha != 1.0:
            output.mul_(alpha)


class VirtualClusterTransport:
    """TIDE programs on tide.VirtualCluster, driven by the shard group's first rank."""

    name = "virtual-cluster"

    def __init__(self, group_of: Any):
        self._group_of = group_of
        self._clusters: dict[tuple[int, int], Any] = {}

    def _cluster(self, topo: tide.Topology) -> Any:
        key = (topo.nodes, topo.gpus_per_node)
        if key not in self._clusters:
            # The cluster runs TIDE's static checker (I1-I4) on every new program set.
            # One worker thread steps every rank: no spinning threads next to the training ranks.
            self._clusters[key] = tide.VirtualCluster(topo, ranks_as="threads", workers=1)
        return self._clusters[key]

    @staticmethod
    def _to_numpy(t: torch.Tensor):
        import ml_dtypes
        t = t.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def _gather(self, group: Any, flat: torch.Tensor) -> list[torch.Tensor] | None:
        lead = group.rank() == 0
        bufs = [torch.empty_like(flat) for _ in range(group.size())] if lead else None
        dist.gather(flat, bufs, group=group, group_dst=0)
        return bufs

    def all_gather(self, tg, inputs, landings):
        group = self._group_of(tg)
        layout = tg.plan.layout
        N = layout.N
        packed = torch.cat([t.reshape(-1) for t in inputs])  # S bytes: this rank's packed shard
        shards = self._gather(group, packed)
        land = torch.empty(layout.S * N, dtype=torch.uint8)
        if shards is not None:
            import numpy as np
            vc = self._cluster(tg.topology)
            sizes = [pl.e for pl in layout.params]
            per_rank = [[self._to_numpy(x) for x in torch.split(s, sizes)] for s in shards]
            ring = tg.ring_index % 2 if tg.ring_index >= 0 else 0
            vc.all_gather(tg.plan, per_rank, resident=tg.adopts, ring_slot=ring)
            raw = np.empty(layout.S * N, dtype=np.uint8)
            vc.arena(tg.plan).read(0, tide.cluster.KIND[f"ring{ring}"], 0, raw)
            land.copy_(torch.from_numpy(raw))
        dist.broadcast(land, group=group, group_src=0)
        for p, out in enumerate(landings):
            off = layout.landing(p, 0)
            out.view(torch.uint8).copy_(land[off: off + out.numel() * out.element_size()])

    def reduce_scatter(self, tg, plan, grads, output, alpha):
        group = self._group_of(tg)
        layout = plan.layout
        flat = torch.cat([g.reshape(-1) for g in grads])
        everyone = self._gather(group, flat)
        outs = None
        if everyone is not None:
            vc = self._cluster(tg.topology)
            sizes = [pl.D * pl.K for pl in layout.params]
            per_rank = [[self._to_numpy(x) for x in torch.split(g, sizes)] for g in everyone]
            res = vc.reduce_scatter(plan, per_rank, scale=float(alpha))
            outs = [torch.from_numpy(o.copy()).to(output.dtype) for o in res]
        mine = torch.empty(layout.E, dtype=output.dtype)
        dist.scatter(mine, outs, group=group, group_src=0)
        output.copy_(mine)


TRANSPORTS = ("auto", "executor", "virtual-cluster", "interim")
_CUDA_KNOBS = ("sum_ctas", "land_ctas")


def make_transport(kind: str, arena: Any, peers: list[str], rank: int, topo: tide.Topology,
                   group_of: Any, options: dict[str, int] | None = None) -> Transport:
    api = _executor_api()
    if kind in ("auto", "executor") and api is not None and arena.shm_name is not None:
        return ExecutorTransport(api, arena, peers, rank, topo, group_of)
    cuda_api = _cuda_executor_api()
    if kind in ("auto", "executor") and cuda_api is not None and arena.fabric is not None:
        knobs = {k: int(v) for k, v in (options or {}).items() if k in _CUDA_KNOBS}
        return CudaExecutorTransport(cuda_api, arena, rank, topo, group_of, **knobs)
    if kind == "executor":
        raise RuntimeError(
            f"tide_torch: transport='executor' needs TIDE's per-rank executor for a "
            f"{arena.device.type} arena (tide._core.RankExecutor on CPU, CudaRankExecutor with "
            "a fabric on CUDA), which this build does not have")
    if kind == "virtual-cluster":
        logger.info("tide_torch: running TIDE programs on tide.VirtualCluster from each shard "
                    "group's first rank (bytes cross torch.distributed)")
        return VirtualClusterTransport(group_of)
    logger.info("tide_torch: this build of tide._core has no per-rank executor for %s arenas; "
                "using the interim torch.distributed landing transport", arena.device.type)
    return InterimTransport(group_of)
