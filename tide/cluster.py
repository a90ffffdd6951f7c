"""VirtualCluster: runs TIDE programs for every rank of a topology on this machine.

backend="cpu" runs the C++ CPU executor (csrc/exec/cpu) over a shared arena; ranks are threads of
this process (ranks_as="threads") or forked processes attached to POSIX shared memory
(ranks_as="processes"). Arrays are numpy; bf16 uses ml_dtypes.bfloat16.

Each plan (group) gets its own symmetric arena and a call sequence number that increments per
call, exactly as on a real cluster: counters are epochs and are never reset.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tide import _core
from tide.plan import rs_bank

try:
    import ml_dtypes

    _DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
               "float16": np.dtype(np.float16)}
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}

KIND = dict(_core.buf_kinds)


@dataclass
class _GroupState:
    arena: object
    seq: int = 0
    programs: dict = field(default_factory=dict)  # call options -> ProgramSet


class VirtualCluster:
    """M x L ranks on one machine. `check`: run the static checker (I1-I4) on every new program
    set before its first use (None: when the world has at most 64 ranks).

    `lean` (scale runs, e.g. 1024 x 8): reduce_scatter generates each rank's RS program while it
    runs (`_core.generate_rs_programs`, [Note: generated programs] in program.h) instead of
    holding every rank's ops, only for the bank a call uses; the checker does not run on them
    (it needs built programs; it proves the same ops over the CI grid). Threads mode only."""

    lean = False  # class default: subclasses with their own __init__ (CudaVirtualCluster) inherit it

    def __new__(cls, topo=None, backend: str = "cpu", *args, **kwargs):
        # Backend hook: backend="cuda" builds the CUDA virtual cluster (tide/cluster_cuda.py).
        if cls is VirtualCluster and backend == "cuda":
            from tide.cluster_cuda import CudaVirtualCluster
            return super().__new__(CudaVirtualCluster)
        return super().__new__(cls)

    def __init__(self, topo, backend: str = "cpu", ranks_as: str = "threads", *,
                 timeout_s: float = 30.0, check: bool | None = None, workers: int = 0,
                 lean: bool = False):
        if backend != "cpu":
            raise _core.PlanError(f"VirtualCluster.backend: {backend!r} is not available here "
                                  "(this build runs backend='cpu')")
        if ranks_as not in ("threads", "processes"):
            raise _core.PlanError(f"VirtualCluster.ranks_as: expected 'threads' or 'processes', got {ranks_as!r}")
        if lean and ranks_as != "threads":
            raise _core.PlanError("VirtualCluster.lean: generated programs run with ranks_as='threads', "
                                  f"got {ranks_as!r}")
        if lean and check:
            raise _core.PlanError("VirtualCluster.lean: the checker needs built programs (pass check=None or False)")
        self.lean = bool(lean)
        self.topo = topo
        self.backend = backend
        self.ranks_as = ranks_as
        self.timeout_s = float(timeout_s)
        self.check = check
        self.workers = int(workers)
        self._groups: dict[int, _GroupState] = {}
        self.faults: dict = {}  # tests: executor fault injection (stall_rank/stall_op/stall_s/dead_rank/dead_op)

    # ---- internals ------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.topo.nodes * self.topo.gpus_per_node

    def _check_plan(self, plan):
        if plan.nodes != self.topo.nodes or plan.gpus_per_node != self.topo.gpus_per_node:
            raise _core.PlanError(f"plan is for {plan.nodes}x{plan.gpus_per_node} ranks, this cluster is "
                                  f"{self.topo.nodes}x{self.topo.gpus_per_node}")

    def _checking(self) -> bool:
        return bool(self.check or (self.check is None and self.world <= 64)) and not self.lean

    def _check_rs_args(self, grads, accumulate):
        N = self.world
        if len(grads) != N:
            raise _core.PlanError(f"reduce_scatter: got grads for {len(grads)} ranks, the cluster has {N}")
        if accumulate is not None and len(accumulate) != N:
            raise _core.PlanError(f"reduce_scatter: accumulate has {len(accumulate)} outputs, expected {N}")

    def _checked(self, progs):
        """Runs the static checker (I1-I4) on a new program set before its first use."""
        if self._checking():
            ok, errors = progs.check(2)
            if not ok:
                raise _core.Error("TIDE static checker rejected the program: " + "; ".join(errors))
        return progs

    def _rs_banks(self, plan, build, scale, accumulate: bool, expert_lane: bool):
        """The RS program sets of the two outbox banks (bank b serves calls with rs_bank(seq) == b),
        checked over three calls with the banks alternating, as they run."""
        banks = tuple(build(plan, bank=b, alpha=float(scale), accumulate=accumulate,
                            expert_lane=expert_lane) for b in (0, 1))
        if self._checking():
            ok, errors = _core.check_calls([[(banks[rs_bank(s)], s) for s in (1, 2, 3)]] * self.world)
            if not ok:
                raise _core.Error("TIDE static checker rejected the RS program: " + "; ".join(errors))
        return banks

    def _programs(self, plan, key, build):
        st = self._groups.get(plan.hash)
        progs = st.programs.get(key) if st else None
        if progs is None:
            progs = self._checked(build())
            if st is None:
                arena = _core.CpuArena(self.world, progs, self.ranks_as == "processes")
                st = self._groups[plan.hash] = _GroupState(arena)
            st.programs[key] = progs
        return st, progs

    def arena(self, plan):
        """The plan's arena (tests: read regions, measure bytes per rank)."""
        return self._groups[plan.hash].arena

    def run(self, plan, calls, bindings):
        """Run explicit per-rank call lists [[(ProgramSet, seq), ...] per rank] (tests, faults)."""
        st = self._groups[plan.hash]
        st.arena.run(calls, bindings, timeout_s=self.timeout_s, workers=self.workers,
                     processes=self.ranks_as == "processes", **self.faults)

    # ---- collectives ----------------------------------------------------------------------
    def all_gather(self, plan, shards, *, resident: bool = True, multicast: bool = False,
                   expert_lane: bool = False, ring_slot: int = 0, poison: bool = False):
        """shards[r][p] (padded (R_p, ...) or unpadded rows) -> full[r][p] with the unsharded
        shape, read from rank r's parameter-major landing (ring slot `ring_slot`)."""
        self._check_plan(plan)
        N = self.world
        ag_name, _, shard_name = _core.plan_dtypes(plan)
        cast = ag_name != shard_name
        resident = resident and not cast
        shapes = _core.plan_shapes(plan)
        lay = plan.layout
        if len(shards) != N:
            raise _core.PlanError(f"all_gather: got shards for {len(shards)} ranks, the cluster has {N}")
        key = ("ag", ring_slot, resident, multicast, expert_lane)
        st, progs = self._programs(plan, key, lambda: _core.build_ag_programs(
            plan, ring_slot=ring_slot, resident=resident, multicast=multicast,
            expert_lane=expert_lane, with_expects=False))
        sdt = _DTYPES[shard_name]
        padded = [[self._pad(shards[r][p], lay.params[p], sdt, r, p) for p in range(lay.P)] for r in range(N)]
        bindings = []
        for r in range(N):
            if resident:  # in-place adoption: the user's shard lives in the arena resident region
                for p in range(lay.P):
                    st.arena.write(r, KIND["resident"], lay.params[p].o, padded[r][p].view(np.uint8))
                bindings.append([])
            else:
                bindings.append([(KIND["shard"], p, padded[r][p].view(np.uint8)) for p in range(lay.P)])
        ring = KIND["ring0" if ring_slot == 0 else "ring1"]
        if poison:
            for r in range(N):
                st.arena.fill(r, ring, 0xFF)
        st.seq += 1
        self.run(plan, [[(progs, st.seq)] for _ in range(N)], bindings)
        adt = _DTYPES[ag_name]
        out = []
        for r in range(N):
            land = np.empty(lay.S * N, dtype=np.uint8)
            st.arena.read(r, ring, 0, land)
            row = []
            for p in range(lay.P):
                pl = lay.params[p]
                a = land[pl.o * N: pl.o * N + pl.s * N].view(adt)
                trailing = tuple(shapes[p][1:])
                row.append(a.reshape((N * pl.R,) + trailing)[: pl.D])
            out.append(row)
        return out

    @staticmethod
    def _pad(x, pl, dtype, r, p):
        x = np.ascontiguousarray(np.asarray(x), dtype=dtype).reshape(-1)
        if x.size > pl.e or (x.size % pl.K if pl.K else 0):
            raise _core.PlanError(f"all_gather: shards[{r}][{p}] has {x.size} elements, expected at most "
                                  f"{pl.e} (R_p={pl.R} rows of {pl.K})")
        if x.size == pl.e:
            return x
        buf = np.zeros(pl.e, dtype=dtype)
        buf[: x.size] = x
        return buf

    def reduce_scatter(self, plan, grads, scale: float = 1.0, accumulate=None):
        """grads[r][p] (unsharded per-parameter gradients) -> outs[r] fp32 shards.

        Seam for TIDE-RS: builds RS programs with `_core.build_rs_programs` (csrc/program,
        RS owner) and runs them like all_gather. Not part of this branch."""
        self._check_plan(plan)
        build = getattr(_core, "build_rs_programs", None)
        if build is None:
            raise NotImplementedError("VirtualCluster.reduce_scatter: TIDE-RS programs are not built in yet")
        return self._reduce_scatter_impl(plan, grads, scale, accumulate, build)

    def _reduce_scatter_impl(self, plan, grads, scale, accumulate, build, expert_lane=False):
        # [Note: RS arena] RS programs number their counters from 0 like AG programs, so an RS
        # group gets its own arena and call sequence (key (hash, expert_lane)); the bank b = rs_bank(seq)
        # alternates two program sets, as Algorithm 1's two-phase pipeline does.
        N = self.world
        lay = plan.layout
        _, grad_name, _ = _core.plan_dtypes(plan)
        shapes = _core.plan_shapes(plan)
        self._check_rs_args(grads, accumulate)
        gkey = (plan.hash, expert_lane)  # the expert lane has its own arena layout and counters
        st = self._rs_groups.get(gkey) if hasattr(self, "_rs_groups") else None
        if st is None:
            self._rs_groups = getattr(self, "_rs_groups", {})
            st = None
        seq = (st.seq if st else 0) + 1
        if self.lean and not expert_lane:  # generated, and only the bank this call uses
            key = ("rs-gen", float(scale), accumulate is not None, rs_bank(seq))
            progs = st.programs.get(key) if st else None
            if progs is None:
                progs = _core.generate_rs_programs(plan, bank=rs_bank(seq), alpha=float(scale),
                                                   accumulate=accumulate is not None)
                if st is None:
                    st = self._rs_groups[gkey] = _GroupState(_core.CpuArena(N, progs, False))
                st.programs[key] = progs
        else:
            key = ("rs", float(scale), accumulate is not None, expert_lane)
            banks = st.programs.get(key) if st else None
            if banks is None:
                banks = self._rs_banks(plan, build, scale, accumulate is not None, expert_lane)
                if st is None:
                    arena = _core.CpuArena(N, banks[0], self.ranks_as == "processes")
                    st = self._rs_groups[gkey] = _GroupState(arena)
                st.programs[key] = banks
            progs = banks[rs_bank(seq)]
        gdt = _DTYPES[grad_name]
        bindings, outs = [], []
        for r in range(N):
            if len(grads[r]) != lay.P:
                raise _core.PlanError(f"reduce_scatter: grads[{r}] has {len(grads[r])} tensors, the group has {lay.P}")
            row = []
            for p in range(lay.P):
                g = np.ascontiguousarray(np.asarray(grads[r][p]), dtype=gdt)
                if g.size != lay.params[p].D * lay.params[p].K:
                    raise _core.PlanError(f"reduce_scatter: grads[{r}][{p}] has {g.size} elements, "
                                          f"expected shape {tuple(shapes[p])}")
                row.append((KIND["grad"], p, g.reshape(-1).view(np.uint8)))  # bf16: no DLPack
            if accumulate is None:
                out = np.zeros(lay.E, dtype=np.float32)
            else:
                out = np.array(accumulate[r], dtype=np.float32, copy=True).reshape(-1)
                if out.size != lay.E:
                    raise _core.PlanError(f"reduce_scatter: accumulate[{r}] has {out.size} elements, expected {lay.E}")
            row.append((KIND["out"], -1, out.view(np.uint8)))
            bindings.append(row)
            outs.append(out)
        st.seq = seq
        st.arena.run([[(progs, seq)] for _ in range(N)], bindings, timeout_s=self.timeout_s,
                     workers=self.workers, processes=self.ranks_as == "processes", **self.faults)
        return outs

    def reduce_scatter_expert(self, plan, grads, scale: float = 1.0, accumulate=None):
        """The expert lane (App. F) for a subgroup with one rank per node (plan L = 1)."""
        self._check_plan(plan)
        return self._reduce_scatter_impl(plan, grads, scale, accumulate, _core.build_rs_programs,
                                         expert_lane=True)

    def reduce_scatter_hsdp(self, plans, grads, scale: float = 1.0):
        """HSDP: grads[g][r][p] for replica groups g (each a shard group on this cluster's
        topology, one plan per group or one shared plan). Each group reduce-scatters with
        TIDE-RS, then the replica all-reduce sums the shard outputs across groups in group
        order (FSDP2's replica all-reduce; stock NCCL on a cluster). Returns outs[g][r]."""
        if not isinstance(plans, (list, tuple)):
            plans = [plans] * len(grads)
        if len(plans) != len(grads) or not grads:
            raise _core.PlanError(f"reduce_scatter_hsdp: {len(plans)} plans for {len(grads)} replica groups")
        shard = [self.reduce_scatter(p, g, scale=scale) for p, g in zip(plans, grads)]
        total = [np.array(shard[0][r], copy=True) for r in range(self.world)]
        for g in range(1, len(shard)):
            for r in range(self.world):
                total[r] += shard[g][r]
        return [[t.copy() for t in total] for _ in shard]

    def rs_arena(self, plan, expert_lane: bool = False):
        """The plan's RS arena (tests: measured bytes per rank, regions)."""
        return self._rs_groups[(plan.hash, expert_lane)].arena
