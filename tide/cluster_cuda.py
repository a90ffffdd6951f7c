"""VirtualCluster backend="cuda": every rank of a topology on this process's GPU.

The CUDA executor (csrc/exec/cuda) runs the same programs the CPU executor runs, over an
in-process fabric: each rank has its own zeroed cudaMalloc arena and its own named streams, and
peers are addressed by plain device pointers. Arrays are torch CUDA tensors or any DLPack device
array (converted with torch.from_dlpack); numpy inputs are copied to the GPU. Outputs are torch
tensors (copies out of the landing / output buffers).

[Note: stream handoff] Inputs are produced on torch's current stream; the executor's streams
are non-blocking and unrelated, so a call first synchronises the current stream, then enqueues
every rank's ops and waits for them (the virtual cluster is synchronous, like the CPU one).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tide import _core
from tide.cluster import KIND, VirtualCluster
from tide.plan import rs_bank

_TORCH_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def _torch():
    import torch
    return torch


@dataclass
class _CudaGroup:
    fabric: object
    seq: int = 0
    programs: dict = field(default_factory=dict)   # key -> ProgramSet
    executors: dict = field(default_factory=dict)  # key -> CudaExecutor


class CudaVirtualCluster(VirtualCluster):
    """M x L ranks on one GPU (device `device`), or on several: `devices=[d0, d1, ...]` puts
    rank r on devices[r % len(devices)] (one process drives every GPU; the fabric enables peer
    access). Same collectives and arguments as the CPU VirtualCluster; inputs and outputs of
    rank r live on rank r's device. `sum_ctas`/`land_ctas` are the SUM/LAND CTA budgets."""

    def __init__(self, topo, backend: str = "cuda", ranks_as: str = "threads", *,
                 timeout_s: float = 30.0, check: bool | None = None, workers: int = 0,
                 device: int = 0, devices=None, sum_ctas: int = 16, land_ctas: int = 4):
        if not _core.built_with_cuda or not _core.cuda_available():
            raise _core.PlanError("VirtualCluster(backend='cuda') needs a CUDA build of tide._core and a GPU")
        self.topo = topo
        self.backend = "cuda"
        self.ranks_as = "threads"
        self.timeout_s = float(timeout_s)
        self.check = check
        self.workers = 0
        self.device = int(device)
        self.devices = [int(d) for d in devices] if devices else [self.device]
        n_dev = _core.cuda_device_count()
        for d in self.devices:
            if not 0 <= d < n_dev:
                raise _core.PlanError(f"VirtualCluster.devices: device {d} does not exist ({n_dev} usable)")
        self.device = self.devices[0]
        self.sum_ctas = int(sum_ctas)
        self.land_ctas = int(land_ctas)
        self._cuda_groups: dict[int, _CudaGroup] = {}
        self.faults: dict = {}  # tests: dead_rank / stall_rank / stall_s (executor level)

    # ---- internals ------------------------------------------------------------------------
    def device_of(self, rank: int) -> int:
        return self.devices[rank % len(self.devices)]

    def _rank_devices(self):
        return [self.device_of(r) for r in range(self.world)]

    def _cuda_programs(self, plan, key, build):
        g = self._cuda_groups.get(plan.hash)
        progs = g.programs.get(key) if g else None
        if progs is None:
            progs = self._checked(build())
            if g is None:
                fabric = _core.CudaFabric(self._rank_devices(), _core.cuda_arena_total(progs))
                g = self._cuda_groups[plan.hash] = _CudaGroup(fabric)
            g.programs[key] = progs
        ex = g.executors.get(key)
        if ex is None:
            ex = g.executors[key] = _core.CudaExecutor(g.fabric, progs, self.timeout_s, self.sum_ctas, self.land_ctas)
        ex.set_faults(self.faults.get("dead_rank", -1), self.faults.get("stall_rank", -1),
                      float(self.faults.get("stall_s", 0.0)))
        return g, progs, ex

    def _region(self, g, progs, rank, kind):
        off, nbytes = _core.cuda_arena_region(progs, KIND[kind])
        return g.fabric.arena_ptr(rank) + off, nbytes

    def _as_cuda(self, x, dtype, device=None):
        torch = _torch()
        if not isinstance(x, torch.Tensor):
            try:
                x = torch.from_dlpack(x)
            except Exception:  # noqa: BLE001 - numpy / lists
                import numpy as np
                a = np.asarray(x)
                if a.dtype.name == "bfloat16":
                    x = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                else:
                    x = torch.from_numpy(np.ascontiguousarray(a))
        dev = self.device if device is None else device
        return x.to(device=f"cuda:{dev}", dtype=dtype).contiguous().reshape(-1)

    def _pad_cuda(self, x, pl, dtype, r, p):
        torch = _torch()
        x = self._as_cuda(x, dtype, self.device_of(r))
        if x.numel() > pl.e or (x.numel() % pl.K if pl.K else 0):
            raise _core.PlanError(f"all_gather: shards[{r}][{p}] has {x.numel()} elements, expected at most "
                                  f"{pl.e} (R_p={pl.R} rows of {pl.K})")
        if x.numel() == pl.e:
            return x
        buf = torch.zeros(pl.e, dtype=dtype, device=x.device)
        buf[: x.numel()] = x
        return buf

    def _sync_devices(self):
        torch = _torch()
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()

    def _run(self, g, ex, bindings):
        self._sync_devices()
        g.seq += 1
        ex.run(g.seq, bindings)
        ex.synchronize()

    # ---- collectives ----------------------------------------------------------------------
    def all_gather(self, plan, shards, *, resident: bool = True, multicast: bool = False,
                   expert_lane: bool = False, ring_slot: int = 0, poison: bool = False):
        """shards[r][p] -> full[r][p] (torch CUDA tensors with the unsharded shape)."""
        torch = _torch()
        self._check_plan(plan)
        N = self.world
        ag_name, _, shard_name = _core.plan_dtypes(plan)
        resident = resident and ag_name == shard_name
        shapes = _core.plan_shapes(plan)
        lay = plan.layout
        if len(shards) != N:
            raise _core.PlanError(f"all_gather: got shards for {len(shards)} ranks, the cluster has {N}")
        key = ("ag", ring_slot, resident, multicast, expert_lane)
        g, progs, ex = self._cuda_programs(plan, key, lambda: _core.build_ag_programs(
            plan, ring_slot=ring_slot, resident=resident, multicast=multicast,
            expert_lane=expert_lane, with_expects=False))
        sdt = getattr(torch, _TORCH_DTYPES[shard_name])
        padded = [[self._pad_cuda(shards[r][p], lay.params[p], sdt, r, p) for p in range(lay.P)] for r in range(N)]
        bindings = []
        ring = "ring0" if ring_slot == 0 else "ring1"
        for r in range(N):
            with torch.cuda.device(self.device_of(r)):  # rank r's copies on rank r's device
                stream = torch.cuda.current_stream().cuda_stream
                if resident:  # in-place adoption: the shard lives in the arena's resident region
                    base, _ = self._region(g, progs, r, "resident")
                    _core.cuda_copies([(base + lay.params[p].o, padded[r][p].data_ptr(), lay.params[p].s, 1, 0, 0)
                                       for p in range(lay.P)], stream)
                    bindings.append([])
                else:
                    bindings.append([(KIND["shard"], p, padded[r][p].data_ptr()) for p in range(lay.P)])
                if poison:
                    base, nbytes = self._region(g, progs, r, ring)
                    _core.cuda_memset(base, 0xFF, nbytes, stream)
        self._run(g, ex, bindings)
        adt = getattr(torch, _TORCH_DTYPES[ag_name])
        out = []
        for r in range(N):
            base, _ = self._region(g, progs, r, ring)
            with torch.cuda.device(self.device_of(r)):
                land = torch.empty(lay.S * N, dtype=torch.uint8, device=f"cuda:{self.device_of(r)}")
                _core.cuda_copies([(land.data_ptr(), base, lay.S * N, 1, 0, 0)], torch.cuda.current_stream().cuda_stream)
            row = []
            for p in range(lay.P):
                pl = lay.params[p]
                a = land[pl.o * N: pl.o * N + pl.s * N].view(adt)
                row.append(a.reshape((N * pl.R,) + tuple(shapes[p][1:]))[: pl.D])
            out.append(row)
        self._sync_devices()
        return out

    def reduce_scatter(self, plan, grads, scale: float = 1.0, accumulate=None, *, poison: bool = False):
        """grads[r][p] (unsharded per-parameter gradients) -> outs[r] fp32 shards (torch CUDA).
        `poison` (tests): start the outputs as NaN instead of zeros, to prove every element is
        written."""
        self._check_plan(plan)
        return self._reduce_scatter_impl(plan, grads, scale, accumulate, _core.build_rs_programs, poison=poison)

    def _reduce_scatter_impl(self, plan, grads, scale, accumulate, build, expert_lane=False, poison=False):
        g, executor, bindings, outs, keep = self._rs_prepare(plan, grads, scale, accumulate, build,
                                                             expert_lane, poison)
        self._run(g, executor(g.seq + 1), bindings)  # g.seq becomes seq
        del keep
        return outs

    def _rs_prepare(self, plan, grads, scale, accumulate, build, expert_lane=False, poison=False):
        # Same programs and keys as the CPU backend: an RS group (plan, expert_lane) has its own
        # arena and call sequence; bank b = rs_bank(seq) alternates the two program sets of a key
        # (two executors over one fabric, which shares the counters' issued values).
        torch = _torch()
        N = self.world
        lay = plan.layout
        _, grad_name, _ = _core.plan_dtypes(plan)
        shapes = _core.plan_shapes(plan)
        self._check_rs_args(grads, accumulate)
        gkey = ("rs", plan.hash, expert_lane)
        g = self._cuda_groups.get(gkey)
        key = ("rs", float(scale), accumulate is not None, expert_lane)
        banks = g.programs.get(key) if g else None
        if banks is None:
            banks = self._rs_banks(plan, build, scale, accumulate is not None, expert_lane)
            if g is None:
                fabric = _core.CudaFabric(self._rank_devices(), _core.cuda_arena_total(banks[0]))
                g = self._cuda_groups[gkey] = _CudaGroup(fabric)
            g.programs[key] = banks

        def executor(seq):
            ekey = key + (rs_bank(seq),)
            ex = g.executors.get(ekey)
            if ex is None:
                ex = g.executors[ekey] = _core.CudaExecutor(g.fabric, banks[rs_bank(seq)], self.timeout_s,
                                                            self.sum_ctas, self.land_ctas)
            ex.set_faults(self.faults.get("dead_rank", -1), self.faults.get("stall_rank", -1),
                          float(self.faults.get("stall_s", 0.0)))
            return ex

        gdt = getattr(torch, _TORCH_DTYPES[grad_name])
        bindings, outs, keep = [], [], []
        for r in range(N):
            if len(grads[r]) != lay.P:
                raise _core.PlanError(f"reduce_scatter: grads[{r}] has {len(grads[r])} tensors, the group has {lay.P}")
            dev = self.device_of(r)
            row = []
            for p in range(lay.P):
                x = self._as_cuda(grads[r][p], gdt, dev)
                if x.numel() != lay.params[p].D * lay.params[p].K:
                    raise _core.PlanError(f"reduce_scatter: grads[{r}][{p}] has {x.numel()} elements, "
                                          f"expected shape {tuple(shapes[p])}")
                keep.append(x)
                row.append((KIND["grad"], p, x.data_ptr()))
            if accumulate is None:
                out = torch.full((lay.E,), float("nan") if poison else 0.0, dtype=torch.float32,
                                 device=f"cuda:{dev}")
            else:
                out = self._as_cuda(accumulate[r], torch.float32, dev).clone()
                if out.numel() != lay.E:
                    raise _core.PlanError(f"reduce_scatter: accumulate[{r}] has {out.numel()} elements, expected {lay.E}")
            row.append((KIND["out"], -1, out.data_ptr()))
            bindings.append(row)
            outs.append(out)
        return g, executor, bindings, outs, keep

    # ---- benches: repeat a call over inputs already in place --------------------------------
    def all_gather_runner(self, plan, shards, *, ring_slot: int = 0):
        """Runs one checked all_gather (resident shards), then returns (outputs, go, landing):
        go() enqueues one more call over the same resident shards and waits for every rank's
        streams; landing(r) is (device pointer, bytes) of rank r's parameter-major landing.
        Needs ag dtype == shard dtype (the shards stay resident in the arena)."""
        ag_name, _, shard_name = _core.plan_dtypes(plan)
        if ag_name != shard_name:
            raise _core.PlanError("all_gather_runner: needs ag dtype == shard dtype (resident shards)")
        out = self.all_gather(plan, shards, ring_slot=ring_slot)
        key = ("ag", ring_slot, True, False, False)
        g, progs, ex = self._cuda_programs(plan, key, None)
        bindings = [[] for _ in range(self.world)]
        ring = "ring0" if ring_slot == 0 else "ring1"

        def go():
            g.seq += 1
            ex.run(g.seq, bindings)
            ex.synchronize()

        def enqueue():
            g.seq += 1
            ex.run(g.seq, bindings)

        go.enqueue, go.synchronize = enqueue, ex.synchronize
        return out, go, lambda r: self._region(g, progs, r, ring)

    def reduce_scatter_runner(self, plan, grads, scale: float = 1.0):
        """Returns (outs, go): go() runs one more reduce_scatter over the same gradients into
        the same outputs (overwritten each call), alternating the two banks as calls do."""
        g, executor, bindings, outs, keep = self._rs_prepare(plan, grads, scale, None, _core.build_rs_programs)
        executor(g.seq + 1), executor(g.seq + 2)  # both banks' executors exist before timing

        def go():
            ex = executor(g.seq + 1)
            g.seq += 1
            ex.run(g.seq, bindings)
            ex.synchronize()

        def enqueue():
            ex = executor(g.seq + 1)
            g.seq += 1
            ex.run(g.seq, bindings)
            return ex

        go.enqueue, go.keep = enqueue, keep
        self._sync_devices()
        go()
        return outs, go

    def reduce_scatter_hsdp(self, plans, grads, scale: float = 1.0):
        """HSDP on the CUDA backend: per-group TIDE-RS, then the replica sum in group order."""
        if not isinstance(plans, (list, tuple)):
            plans = [plans] * len(grads)
        if len(plans) != len(grads) or not grads:
            raise _core.PlanError(f"reduce_scatter_hsdp: {len(plans)} plans for {len(grads)} replica groups")
        shard = [self.reduce_scatter(p, g, scale=scale) for p, g in zip(plans, grads)]
        total = [shard[0][r].clone() for r in range(self.world)]
        for g in range(1, len(shard)):
            for r in range(self.world):
                total[r] += shard[g][r]
        return [[t.clone() for t in total] for _ in shard]
