"""The one place where tide_torch moves bytes between ranks: calls into TIDE's call runtime.

The adapter hands the transport per-parameter tensors whose addresses the plan fixed:

- ``all_gather(tg, inputs, landings)``: ``inputs[p]`` is this rank's padded shard of parameter
  p: the adopted resident shard (read in place), or the fp32 master shard that the transport
  casts into the group's receive-stage slot (mixed precision). ``landings[p]`` is the padded
  unsharded buffer (``N * e_p`` items at arena offset ``landing(p, 0)`` of p's chunk; for a pull
  landing of a group that moved to its own storage, FSDP2's own all-gather output:
  all_gather.py [Note: own-storage landing]). Afterwards
  every rank's shard r of p sits at ``landing(p, r)`` (Eq. 2): no copy-out. With a cast (one
  node or several), every rank pulls its local peers' staged shards, and across nodes each
  Bruck round's stage area once it arrived, into its own landing ([Note: pull landing] in
  tide/program.h, ag_program.cc): its landing is written by it alone, on its own streams, so
  the call needs no round that waits for the peers' callers to free their landings, only their
  staged shards. A group of several
  dtype classes or of more than 256 parameters runs one TIDE-AG per chunk (groups.py
  [Note: chunks]); with
  ``post_forward``, ``inputs[p]`` is FSDP2's post-forward shard and the re-gather runs over the
  post-forward group (groups.py [Note: post-forward mesh]).
- ``reduce_scatter(tg, plan, which, grads, output, alpha)``: ``grads[p]`` is the unpadded
  gradient of ``plan``'s parameter p (autograd's tensor for In-Place, the vacated ring slot for
  Slot-Reuse) in ``plan``'s gradient dtype (the group's plan, its fp32-gradient plan, or a
  sub-plan; ``which`` names its session); ``output`` is the plan's fp32 slice of FSDP2's
  reduce-scatter output, whose ``as_strided`` views at ``o32_p`` are the sharded grads.
  ``output = alpha * sum_r grads_r`` over this rank's rows, padding rows contributing zero.

Every call goes through one ``tide._core.GroupSession`` per (group, collective, plan) over this
rank's executor: the session owns the program sets, the call sequence numbers, the TIDE-RS bank
rule and the CTA budgets; the counter ranges come from the arena's CounterSpace (placement.py,
in group order on every rank). The transport only turns tensors into buffers:

- ``ExecutorTransport`` ("tide-executor", CPU): ``tide._core.RankExecutor`` over every rank's
  POSIX shared-memory arena (names exchanged at enable time); a call runs this rank's program
  and returns when it is done.
- ``CudaExecutorTransport`` ("tide-cuda-executor"): ``tide._core.cuda.RankExecutor`` over the
  arena's fabric (``IpcFabric``, or ``NcclFabric`` with ``enable(fabric="nccl")``); a call is
  enqueued on torch's current stream (FSDP2's all-gather or reduce-scatter stream): the program's
  streams wait for that stream's prior work and it waits for the call, no host synchronisation.

A ``tide.TimeoutError`` from a call or ``synchronize()`` leaves with the survivors' diagnosis
appended (tide/diagnosis.py over torch's default store): the chain of posted roots down to the
rank that stopped.

``close()`` drops the executor and the sessions (runtime.py [Note: runtime lifetime]); a call
afterwards raises instead of reaching freed state.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

import tide
from tide.diagnosis import diagnosed

AG, RS = "all_gather", "reduce_scatter"
KIND = dict(tide._core.buf_kinds)


def _default_store() -> Any:
    """torch's default key-value store (init_process_group's), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _annotated(name: str):
    """A ``tide::<op>`` range in a running torch.profiler's trace (the host time of the call,
    enqueue included: tide_apps/bench/timeline.py); nothing when no profiler runs."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _buffer(kind: str, index: int, t: torch.Tensor) -> tuple:
    return (KIND[kind], index, t.data_ptr(), t.numel() * t.element_size())


class ExecutorTransport:
    """TIDE-AG / TIDE-RS through this rank's sessions over a CPU RankExecutor (see the module
    docstring). ``executor``: a ``tide._core.CallExecutor`` of this rank."""

    name = "tide-executor"

    def __init__(self, executor: Any, arena: Any, rank: int, topo: tide.Topology,
                 group_of: Any = None, timeout_s: float = 30.0):
        self._exec = executor
        self._timeout_s = timeout_s
        self._regions = {r.name: (r.offset, r.nbytes) for r in arena.regions.values()}
        self._sessions: dict[tuple, Any] = {}
        self._group_of = group_of
        self._world = topo.nodes * topo.gpus_per_node
        self._rank = rank
        self.rank_executor = None  # CPU: the core's RankExecutor (tests inspect its mappings)
        self.closed = False

    def close(self) -> None:
        """Drops this rank's sessions and executor (after the rank's last TIDE call). Idempotent."""
        self.closed = True
        self._sessions.clear()
        self._exec = self.rank_executor = None

    def _streams(self) -> list | None:
        return None

    def _members(self, tg: Any) -> list | None:
        """The shard group's global ranks when it is a sub-group (HSDP), else None."""
        if self._group_of is None:
            return None
        ranks = list(dist.get_process_group_ranks(self._group_of(tg)))
        return None if ranks == list(range(self._world)) else ranks

    @staticmethod
    def pulls(plan: Any, post_forward: bool) -> bool:
        """Whether the AG of ``plan`` pulls into each rank's own landing (see the module note):
        a cast (the peers pull from the stage, on any number of nodes), not the post-forward
        re-gather."""
        return not post_forward and plan.shard_dtype != plan.ag_dtype

    def session(self, tg: Any, plan: Any, which: str, chunk: Any = None, members=None,
                pull: bool = False) -> Any:
        """The group's session for `which` (a chunk's "ag", "rs", "rs32": the fp32-gradient
        plan, or a TIDE-RS sub-plan's "sub<k>", reduce_scatter.py [Note: RS parts]); `chunk`:
        the all-gather's chunk (its landing and resident shards, groups.py [Note: chunks])."""
        if self.closed:
            raise RuntimeError("tide_torch: a TIDE collective after the transport was released "
                               "(handle.disable() or interpreter exit)")
        key = (tg.index, which)
        s = self._sessions.get(key)
        if s is None:
            kind = AG if chunk is not None else RS
            placement: dict[str, Any] = {}
            if kind == AG:
                region = self._regions[tg.slot]
                placement = dict(ring_slot=tg.ring_index % 2 if tg.ring_index >= 0 else 0,
                                 resident=chunk.adopts and members is None, landing_region=tg.slot,
                                 landing_offset=chunk.unsharded_offset - region[0],
                                 resident_offset=(chunk.resident_offset - self._regions["resident"][0]
                                                  if chunk.adopts and members is None else 0),
                                 pull_landing=pull)
            s = tide._core.GroupSession(plan, self._exec, [kind], group=tg.index,
                                        counter_bases={kind: tg.counter_bases[which]},
                                        members=members or self._members(tg), **placement)
            self._sessions[key] = s
        return s

    def all_gather(self, tg, inputs, landings, post_forward=False) -> int:
        """Runs tg's TIDE-AG; returns how many of its chunks pulled ([Note: pull landing])."""
        with _annotated("tide::all_gather"):
            return self._all_gather(tg, inputs, landings, post_forward)

    def _all_gather(self, tg, inputs, landings, post_forward) -> int:
        pulled = 0
        for c in tg.chunks:  # one TIDE-AG per chunk, in order on this stream
            adopted = c.adopts and not post_forward
            bindings = [] if adopted else [_buffer("shard", i, inputs[p]) for i, p in enumerate(c.params)]
            pull = self.pulls(c.plan, post_forward)
            if pull:  # the landings are this rank's own buffers ([Note: pull landing])
                bindings += [_buffer("landing", i, landings[p]) for i, p in enumerate(c.params)]
            s = (self.session(tg, c.plan_post_forward, c.key("agpf"), chunk=c,
                              members=tg.post_forward_ranks) if post_forward
                 else self.session(tg, c.plan, c.key("ag"), chunk=c, pull=pull))
            diagnosed(lambda: s.all_gather([bindings], self._streams()), self._rank, self._timeout_s,
                      _default_store)
            pulled += pull
        return pulled

    def reduce_scatter(self, tg, plan, which, grads, output, alpha):
        with _annotated("tide::reduce_scatter"):
            bindings = [_buffer("grad", p, g) for p, g in enumerate(grads)]
            bindings.append(_buffer("out", -1, output))
            s = self.session(tg, plan, which)
            diagnosed(lambda: s.reduce_scatter(float(alpha), False, [bindings], self._streams()), self._rank,
                      self._timeout_s, _default_store)


class CudaExecutorTransport(ExecutorTransport):
    """TIDE-AG / TIDE-RS on CUDA through this rank's sessions over a CUDA RankExecutor; each call
    is enqueue-only on torch's current stream. Errors (a peer's timeout names rank, op and seq)
    surface from the call that detects them or from ``synchronize()``."""

    name = "tide-cuda-executor"

    def _streams(self) -> list:
        return [torch.cuda.current_stream().cuda_stream]

    def synchronize(self) -> None:
        if self.closed:
            return
        diagnosed(self._exec.synchronize, self._rank, self._timeout_s, _default_store)


def executor_counts(transport: Any) -> dict[str, int]:
    """The executor's runs whose entry fence waited for the peers' arrival (``arrival_fences``:
    a TIDE-AG pushing into their ring slots, one cross-rank round more than the data,
    [Note: entry fence]) and, on CUDA, its calls captured and launched as graphs
    (exec/cuda/graph.h); {} when the transport is closed."""
    ex = getattr(transport, "_exec", None)
    if ex is None:
        return {}
    out = {"arrival_fences": ex.arrival_fences}
    if isinstance(transport, CudaExecutorTransport):
        out.update(graph_captures=ex.graph_captures, graph_launches=ex.graph_launches)
    return out


def rail_counts(rail: Any) -> dict[str, int]:
    """An NCCL rail's host share ([Note: rail deadline] in fabric/nccl.cc): its send/recv groups
    (``rail_groups``), those whose enqueue the host had to poll to completion (a non-blocking
    communicator's ncclInProgress: ``rail_host_waits``) and the microseconds it polled
    (``rail_host_wait_us``); {} for no rail or the CPU's gloo rail."""
    if not hasattr(rail, "in_progress_waits"):
        return {}
    return {"rail_groups": rail.groups, "rail_host_waits": rail.in_progress_waits,
            "rail_host_wait_us": int(rail.in_progress_wait_s * 1e6)}


def cuda_executor_available() -> bool:
    """Whether this build can run TIDE's programs on CUDA ranks (executor + CUDA-IPC fabric)."""
    return bool(tide._core.cuda.built and tide._core.cuda.available())


TRANSPORTS = ("auto", "executor")


def make_transport(arena: Any, peers: list[str], rank: int, topo: tide.Topology, group_of: Any,
                   options: Any = None, rail: Any = None) -> ExecutorTransport:
    """This rank's transport over `arena` (CPU: the peers' shared-memory names, "" for a rank whose
    arena this rank must not map; CUDA: the arena's fabric, its peers already open). `options`:
    tide.ExecutorOptions (its ``rails``: how other nodes are reached); `rail`: the CPU rail of
    two-sided rails (tide_torch.rails.GlooRail)."""
    regions = {r.name: (r.offset, r.nbytes) for r in arena.regions.values()}
    options = options or tide.ExecutorOptions()
    opts = options.as_dict()
    if arena.shm_name is not None:
        ex = tide._core.RankExecutor(rank, topo.nodes, topo.gpus_per_node, peers, arena.nbytes,
                                     regions=regions, options=opts)
        if options.rails == "two_sided":
            if rail is None:
                raise RuntimeError("tide_torch: two-sided rails on CPU need a rail (GlooRail)")
            ex.set_rail(rail)
        t = ExecutorTransport(tide._core.CpuRankExecutor(ex, regions), arena, rank, topo, group_of,
                              options.timeout_s)
        t.rank_executor = ex
        return t
    if arena.fabric is None:
        raise RuntimeError(f"tide_torch: the {arena.device.type} arena has no fabric for TIDE's "
                           "CUDA executor")
    ex = tide._core.cuda.RankExecutor(arena.fabric, rank, topo.nodes, topo.gpus_per_node,
                                      regions=regions, options=opts)
    if options.rails == "two_sided":
        if rail is None:
            raise RuntimeError("tide_torch: two-sided rails on CUDA need an NcclRail")
        ex.set_rail(rail)
    return CudaExecutorTransport(ex, arena, rank, topo, group_of, options.timeout_s)
