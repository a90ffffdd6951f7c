"""Finding FSDP2 parameter groups, deciding which ones TIDE serves, and planning them.

A group is served by TIDE when it meets the TIDE contract (paper §2, fsdp2.md): dim-0 sharding
over more than one rank (or a single-rank job, see [Note: world 1]), plain tensors or DTensor
(tensor-parallel) parameters whose local tensors FSDP2 shards, or whose local tensors implement
FSDP2's all-gather extension (``fsdp_pre_all_gather``: its outputs are gathered, extensions.py
[Note: all-gather extensions]), no CPU offload, per parameter a bf16, fp16 or fp32 all-gather dtype from a shard of
the same dtype or an fp32 shard (the all-gather's CAST), a bf16, fp16 or fp32 reduce dtype, and
a shard group whose ranks are node-major on the topology. Parameters of one group may differ in
all of these dtypes (bf16 weights with fp32 norms, torch 2.15's per-parameter policies): the group
is planned in chunks of one dtype class each, and so is a group of more than 256 parameters (the
planner's limit; see [Note: chunks]). Everything else falls back to stock FSDP2 with one log
line. Gradients may differ in dtype per parameter and may be missing for some parameters
(reduce_scatter.py, [Note: RS parts]).

[Note: DTensor parameters]
With tensor (or expert) parallelism, or on torchtitan's full SPMD mesh even at TP 1, FSDP2's
parameters are DTensors: FSDP2 shards, gathers and reduces their *local* tensors over the shard
(dp) sub-mesh, and wraps the gathered local tensor back into a DTensor with the TP placements
(``init_unsharded_param``). TIDE works on the same local tensors, so nothing changes: the plan's
shapes are the local shapes (``FSDPParam._orig_size``), the shard group is the dp sub-mesh's
process group, its topology is that group's ranks on the job's topology (``tide.ranks.group_topology``),
and the landing is the TP-local tensor.

[Note: post-forward mesh]
With ``reshard_after_forward=<int>`` FSDP2 keeps, after forward, each rank's 1/n of the
gathered parameter over a smaller (post-forward) group of n ranks: rows [r' N R / n, (r' + 1)
N R / n) of the padded unsharded tensor, cut from TIDE's landing. Backward re-gathers over that
group. Planned over the post-forward group's topology with the padded shapes (N R_p rows), the
re-gather's plan has R'_p = N R_p / n and lands every parameter at the same addresses as the
group's plan (o'_p n = o_p N), so it lands in place: each rank's post-forward shard (bf16, a user
buffer, no cast) goes straight to its rows of every peer's landing. Planned at enable(), one per
chunk, with counters of their own; a group where the two layouts would differ keeps those
re-gathers on stock (counted).

[Note: chunks]
One plan has one all-gather dtype and one shard dtype, and at most 256 parameters
(``tide::kMaxParams``; per-expert ``nn.Linear`` MoE layers have more). A group is cut into
chunks: its parameters of one dtype class (all-gather dtype, shard dtype) in group order, 256 at
a time (``tide.plan.plan_classes``); each chunk holds its parameters' group indices, which need
not be consecutive (bf16 weights between fp32 norms), since TIDE lands every parameter at its own
planned address. Each chunk is planned on its own, with its own sessions and counter ranges; one
FSDP2 all-gather runs one TIDE-AG per chunk, back to back on the same stream, each landing in its
own part of the group's landing storage, each parameter on the wire in its own dtype. A uniform
group of at most 256 parameters is one chunk. Reduce-scatters are cut
into parts by FSDP2's packing order and gradient dtype (reduce_scatter.py [Note: RS parts]); a
part that is a whole chunk in its all-gather dtype runs on the chunk's plan. A group of several
chunks (at most 256 parameters) also plans itself whole with fp32 gradients
(``TideGroup.rs_bound``): never run, it sizes the TIDE-RS scratch and counter ranges that every
sub-plan of the group must fit.
Chunks hold items: a group's AG items (``TideGroup.items``: one per parameter, one per row of a
Shard(k > 0) parameter, tide/plan.py [Note: Shard(k) as rows]; one per pre-all-gather output of an
extension parameter, extensions.py) and RS items (``TideGroup.rs_items``: the same without
extensions); a group with extension parameters has its TIDE-RS chunks apart
(``TideGroup.rs_chunks``; otherwise the same list).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import tide
from tide import env
from tide import ranks as ranks_
from tide.plan import MAX_PARAMS, RS_SCRATCH, plan_classes, plan_fitting, regather_plan, shard_rows
from tide_torch import _patches, extensions

logger = logging.getLogger("tide_torch")

# [Note: world 1]
# A single-rank job keeps stock FSDP2 by default (enable.py's SINGLE_RANK, one log line): there is
# nothing to gather or reduce, stock's casts and copy are what TIDE would run too, and TIDE's ring
# slots would only add memory (measured on one H200: BENCHMARKS.md). With
# ``enable(serve_single_rank=True)`` it is served (e.g. tests on one GPU). FSDP2 never calls its
# all-gather there: ``wait_for_unshard`` casts the shard straight into ``all_gather_outputs``,
# which are TIDE's landing views, so parameters still live at their planned addresses and ring
# slots are acquired from a per-instance ``init_all_gather_outputs`` (all_gather.py). Nor does it
# call the reduce-scatter comm: it copies the packed input into the output, so TIDE-RS (N = 1)
# writes that input from the per-parameter gradients in place of ``_chunk_cat``
# (reduce_scatter.py). A shard group of one rank inside a larger job keeps stock collectives.

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
PLAN_OPTIONS = ("w_wave", "k", "n_part", "n_stg", "chunk_bytes", "sum_ctas", "land_ctas")


class TideEnableError(RuntimeError):
    """tide_torch.enable() cannot proceed (message says why and what to do)."""


@dataclass(eq=False)
class Chunk:
    """Parameters of one dtype class of a group, with one plan (see [Note: chunks])."""

    index: int                     # position among the group's chunks
    params: tuple[int, ...]        # its AG items' indices, ascending (item p is parameter p in a
                                   # group without extensions; an RS chunk's: parameters)
    plan: Any                      # tide Plan
    ag_dtype: torch.dtype = torch.bfloat16     # its all-gather (unsharded) dtype
    shard_dtype: torch.dtype = torch.bfloat16  # its sharded (master) dtype
    extension: bool = False        # pre-all-gather outputs (extensions.py [Note: all-gather extensions])
    plan_fp32_grads: Any = None    # the same parameters, fp32 gradients
    plan_post_forward: Any = None  # the post-forward re-gather's plan ([Note: post-forward mesh])
    unsharded_offset: int = -1     # arena byte offset of its parameter-major landing buffer
    resident_offset: int = -1      # adopted shards (-1: not adopting)
    stage_offset: int = -1         # receive-stage slot for the mixed-precision cast (-1: no cast)

    @property
    def casts(self) -> bool:
        return self.ag_dtype != self.shard_dtype

    @property
    def adopts(self) -> bool:
        return not self.casts and not self.extension

    @property
    def label(self) -> str:
        """Its parameters as runs of group indices: "0:256", "0,2:5"."""
        runs, start = [], self.params[0]
        for a, b in zip(self.params, self.params[1:] + (None,)):
            if b != a + 1:
                runs.append(f"{start}:{a + 1}" if a > start else f"{start}")
                start = b
        return ",".join(runs)

    def key(self, which: str) -> str:
        """Its session / counter key: "ag", "rs", "rs32" for chunk 0, "ag:1", ... after."""
        return which if self.index == 0 else f"{which}:{self.index}"


@dataclass(eq=False)
class TideGroup:
    """TIDE's view of one FSDPParamGroup: its plan and where its bytes live in the arena."""

    index: int                     # position among the model's FSDP groups (module order)
    fqn: str
    pg: Any                        # FSDPParamGroup
    is_root: bool
    state: Any = None              # the module's FSDPState (explicit prefetch lists)
    siblings: int = 1              # param groups of the same module (they unshard together)
    fallback: str | None = None    # reason when served by stock FSDP2
    # Why the group left the arena's landing for storage of its own at run time (placement.py
    # [Note: ring depth]); None while it lands in the arena.
    moved: str | None = None
    chunks: list[Chunk] = field(default_factory=list)  # its plans (empty on fallback)
    world: int = 1
    topology: tide.Topology | None = None
    ag_dtypes: list[torch.dtype] = field(default_factory=list)     # per parameter: all-gather
    shard_dtypes: list[torch.dtype] = field(default_factory=list)  # per parameter: sharded (master)
    shapes: list[tuple[int, ...]] = field(default_factory=list)       # per parameter
    item_shapes: list[tuple[int, ...]] = field(default_factory=list)  # per AG item (planned)
    chunk_index: list[int] = field(default_factory=list)  # per AG item: its chunk
    local_index: list[int] = field(default_factory=list)  # per AG item: its index in its chunk's plan
    rs_bound: Any = None           # the whole group's fp32-gradient plan when it has several chunks
    # AG items (extensions.py [Note: all-gather extensions]): one per parameter, or one per
    # pre-all-gather output of an extension parameter.
    items: list[tuple[int, int]] = field(default_factory=list)     # item -> (parameter, output)
    param_items: list[list[int]] = field(default_factory=list)     # parameter -> its items
    item_dtypes: list[torch.dtype] = field(default_factory=list)   # per item: its landing dtype
    extension: list[bool] = field(default_factory=list)            # per parameter
    shard_dims: list[int] = field(default_factory=list)            # per parameter: FSDP2's Shard(k)
    # RS items: one per parameter, or one per row of a Shard(k > 0) parameter (tide/plan.py
    # [Note: Shard(k) as rows]); a plain parameter's AG items are its RS items.
    rs_items: list[tuple[int, int]] = field(default_factory=list)  # item -> (parameter, row)
    param_rs_items: list[list[int]] = field(default_factory=list)
    rs_shapes: list[tuple[int, ...]] = field(default_factory=list)
    rs_elements: list[int] = field(default_factory=list)
    rs_chunks: list[Chunk] = field(default_factory=list)  # TIDE-RS plans over the RS items
    rs_chunk_index: list[int] = field(default_factory=list)
    rs_local_index: list[int] = field(default_factory=list)
    # Placement (filled by placement.py)
    slot: str = ""                 # "ring0", "ring1" or "fixed"
    ring_index: int = -1
    # Runtime views (filled on activation)
    landing_views: list[torch.Tensor] = field(default_factory=list)
    input_views: list[torch.Tensor] = field(default_factory=list)
    resident_views: list[torch.Tensor] = field(default_factory=list)
    param_landing: list[torch.Tensor] = field(default_factory=list)   # per parameter (not extensions)
    param_resident: list[torch.Tensor] = field(default_factory=list)  # per parameter (None: not adopted)
    runtime: Any = None
    previous_copy_out: Any = None  # the group's FSDP2 copy-out seam before TIDE (where it has one)
    counter_bases: dict[str, int] = field(default_factory=dict)  # Chunk.key(...) or "sub<k>" -> first counter
    post_forward_ranks: list[int] = field(default_factory=list)  # reshard_after_forward=int's group
    elements: list[int] = field(default_factory=list)        # e: padded shard elements per AG item
    # TIDE-RS parts (reduce_scatter.py, [Note: RS parts])
    mode: str = "in_place"
    plan_options: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)           # parameter FQNs, in group order
    param_index: dict[int, int] = field(default_factory=dict)  # id(FSDPParam) -> group index
    shard_numels: list[int] = field(default_factory=list)    # padded shard elements per parameter
    counter_pool: list[int] = field(default_factory=list)    # free sub-plan counter ranges
    counter_range: int = 0                                   # counters one RS range holds
    sub_plans: dict[tuple, tuple[Any, str]] = field(default_factory=dict)

    @property
    def eligible(self) -> bool:
        return self.fallback is None

    @property
    def plan(self) -> Any:
        """The group's plan when it is one chunk (None on fallback or in chunks)."""
        return self.chunks[0].plan if len(self.chunks) == 1 else None

    @property
    def unsharded_bytes(self) -> int:
        return sum(c.plan.layout.S * c.plan.layout.N for c in self.chunks)

    def fall_back(self, reason: str) -> None:
        self.fallback, self.chunks, self.rs_chunks, self.rs_bound = reason, [], [], None

    @property
    def has_extensions(self) -> bool:
        return any(self.extension)

    def set_chunks(self, chunks: list[Chunk], rs_chunks: list[Chunk] | None = None) -> None:
        """Its AG chunks (over items) and RS chunks (over parameters; the same list in a group
        without extensions), and each item's / parameter's chunk and index in its plan."""
        self.chunks = chunks
        self.rs_chunks = chunks if rs_chunks is None else rs_chunks

        def index(cs):
            n = sum(len(c.params) for c in cs)
            which, local = [0] * n, [0] * n
            for c in cs:
                for i, p in enumerate(c.params):
                    which[p], local[p] = c.index, i
            return which, local
        self.chunk_index, self.local_index = index(chunks)
        self.rs_chunk_index, self.rs_local_index = index(self.rs_chunks)
        if not self.items:  # dim-0 parameters without extensions: item p is parameter p
            n = len(self.chunk_index)
            self.items, self.param_items = [(p, 0) for p in range(n)], [[p] for p in range(n)]
            self.rs_items, self.param_rs_items = list(self.items), [[p] for p in range(n)]
            self.extension, self.shard_dims = [False] * n, [0] * n
            self.item_dtypes = [self.chunk_of(p).ag_dtype for p in range(n)]

    @property
    def status(self) -> str:
        """What ranks compare: same plan hashes and slot, or stock."""
        if self.fallback is not None:
            return "stock"
        hashes = "/".join(f"{c.plan.hash:016x}" + (f"+{c.plan_fp32_grads.hash:016x}"
                                                    if c.plan_fp32_grads is not None else "")
                          for c in self.chunks + ([] if self.rs_chunks is self.chunks
                                                  else self.rs_chunks))
        return f"tide:{hashes}:{self.slot}"

    def chunk_of(self, i: int) -> Chunk:
        """AG item i's chunk."""
        return self.chunks[self.chunk_index[i]]

    def rs_chunk_of(self, i: int) -> Chunk:
        """RS item i's TIDE-RS chunk."""
        return self.rs_chunks[self.rs_chunk_index[i]]

    def rs_plan(self, params: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, str]:
        """The TIDE-RS plan and session key for gradients of ``params`` (RS items, in FSDP2's
        packing order) in ``dtype``; see [Note: RS parts] in reduce_scatter.py. Raises
        reduce_scatter.HandBack when no plan can serve them."""
        from tide_torch.reduce_scatter import HandBack
        chunk = self.rs_chunk_of(params[0])
        if params == chunk.params:
            if dtype == chunk.ag_dtype:
                return chunk.plan, chunk.key("rs")
            if dtype == torch.float32 and chunk.plan_fp32_grads is not None:
                return chunk.plan_fp32_grads, chunk.key("rs32")
        key = (params, dtype)
        got = self.sub_plans.get(key)
        if got is not None:
            return got
        if dtype not in _DTYPE_NAMES:
            raise HandBack(f"{dtype} gradients (TIDE-RS reads bf16, fp16 or fp32)")
        # A sub-plan only reduces: any valid (all-gather, shard) pair serves, its first chunk's.
        sig = tide.GroupSignature(
            shapes=[self.rs_shapes[i] for i in params], ag_dtype=_DTYPE_NAMES[chunk.ag_dtype],
            grad_dtype=_DTYPE_NAMES[dtype], shard_dtype=_DTYPE_NAMES[chunk.shard_dtype],
            names=tuple(self.names[self.rs_items[i][0]] for i in params))
        regions = {n: self.runtime.arena.region(n).nbytes for n in RS_SCRATCH}
        try:
            plan = plan_fitting(sig, self.topology, self.mode, self.plan_options,
                                          counters=self.counter_range, regions=regions,
                                          rails=self.runtime.rails)
        except tide.PlanError as e:
            raise HandBack(f"sub-plan: {e}") from None
        if not self.counter_pool:
            raise HandBack(f"all {len(self.sub_plans)} sub-plan counter ranges are in use "
                           "(distinct gradient patterns of this group)")
        which = f"sub{len(self.sub_plans)}"
        self.counter_bases[which] = self.counter_pool.pop(0)
        self.sub_plans[key] = (plan, which)
        return plan, which

    def landing_address(self, i: int) -> int:
        """Planned address of AG item i's unsharded data (rank 0's landing of i, Eq. 2)."""
        c = self.chunk_of(i)
        return self.runtime.arena.base_ptr + c.unsharded_offset + c.plan.layout.landing(self.local_index[i], 0)


def find_groups(model: nn.Module) -> list[TideGroup]:
    """All FSDP2 param groups under ``model`` in module (pre-)order, which for sequential models
    is their forward execution order."""
    from torch.distributed.fsdp import FSDPModule
    groups: list[TideGroup] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        pgs = _patches.param_groups(state)
        for k, pg in enumerate(pgs):
            if id(pg) in seen:
                continue
            seen.add(id(pg))
            fqn = name or "<root>"
            groups.append(TideGroup(index=len(groups), fqn=fqn if len(pgs) == 1 else f"{fqn}#{k}",
                                    pg=pg, is_root=module is model, state=state,
                                    siblings=len(pgs)))
    if not groups:
        raise TideEnableError(
            f"tide_torch.enable() found no FSDP2 module in {type(model).__name__}: call "
            "fully_shard(...) on the model (and its blocks) first, then tide_torch.enable(model)")
    return groups


def resolve_topology(topology: tide.Topology | None, world: int) -> tide.Topology:
    """Explicit topology, else LOCAL_WORLD_SIZE from the launcher, else one node (tide.env)."""
    if topology is not None:
        if not isinstance(topology, tide.Topology):
            raise TideEnableError(f"tide_torch.enable(topology=...): expected a tide.Topology(nodes, "
                                  f"gpus_per_node), got {type(topology).__name__} {topology!r}")
        for name in ("nodes", "gpus_per_node"):
            v = getattr(topology, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TideEnableError(f"tide_torch.enable(topology=...): {name} must be an int >= 1, "
                                      f"got {v!r}")
        if topology.world != world:
            raise TideEnableError(
                f"topology {topology} has {topology.world} ranks but the default process group "
                f"has {world}")
        return topology
    try:
        return env.launcher_topology(world)
    except ValueError as e:
        raise TideEnableError(str(e)) from None


def _why_not(tg: TideGroup, names: dict[int, str]) -> str | None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    pg = tg.pg
    problems = _patches.check_group(pg)
    if problems:
        return "; ".join(problems)
    if not isinstance(pg.mesh_info, FSDPMeshInfo):
        return "not sharded (replicate-only mesh)"
    fsdp_params = pg.fsdp_params
    if len(fsdp_params) == 0:
        return "no parameters"
    tg.world = pg.mesh_info.shard_process_group.size()
    if tg.world == 1 and dist.get_world_size() > 1:
        return "shard world size 1 inside a larger job"
    for fp in fsdp_params:
        who = names.get(id(fp.sharded_param), "?")
        if fp.fsdp_placement.dim != 0 and tg.world == 1:
            return f"{who}: Shard({fp.fsdp_placement.dim}) placement in a single-rank job"
        if extensions.has_extension(fp) and tg.world == 1:
            return f"{who}: fsdp_pre_all_gather extension in a single-rank job"
        if fp.offload_to_cpu:
            return "CPU offload"  # See docs/fallbacks.md
    # Per parameter, the mixed-precision policy as FSDP2 resolved it (every revision keeps it on
    # the FSDPParam; 2.15 resolves it per parameter): dtypes may differ within the group
    # ([Note: chunks]).
    tg.ag_dtypes, tg.shard_dtypes = [], []
    for fp in fsdp_params:
        who = names.get(id(fp.sharded_param), "?")
        shard = fp.sharded_param.dtype
        ag = fp.mp_policy.param_dtype or shard
        reduce = fp.mp_policy.reduce_dtype or ag
        if shard not in _DTYPE_NAMES or ag not in _DTYPE_NAMES:
            return f"{who}: {shard} parameter gathered as {ag} (TIDE gathers bf16, fp16 or fp32)"
        if ag != shard and shard != torch.float32:
            return f"{who}: {shard} shards gathered as {ag} (TIDE casts fp32 shards only)"
        if reduce not in _DTYPE_NAMES:
            return f"{who}: reduce dtype {reduce} (TIDE-RS sums in fp32 into bf16, fp16 or fp32)"
        tg.ag_dtypes.append(ag)
        tg.shard_dtypes.append(shard)
    return None


def plan_group(tg: TideGroup, topo: tide.Topology, mode: str, options: dict[str, int],
               names: dict[int, str]) -> None:
    """Fills tg.chunks, or tg.fallback with the reason. Never raises for an unsupported group."""
    reason = _why_not(tg, names)
    if reason is None:
        shard_pg = tg.pg.mesh_info.shard_process_group
        ranks = dist.get_process_group_ranks(shard_pg)
        tg.topology = ranks_.group_topology(ranks, topo)
        if tg.topology is None:
            reason = f"shard group ranks {ranks} are not node-major on {topo}"
    if reason is None:
        fsdp_params = tg.pg.fsdp_params
        tg.shapes = [tuple(fp._orig_size) for fp in fsdp_params]
        tg.names = [names.get(id(fp.sharded_param), "") for fp in fsdp_params]
        tg.param_index = {id(fp): p for p, fp in enumerate(fsdp_params)}
        tg.shard_numels = [fp.padded_sharded_param_size.numel() for fp in fsdp_params]
        tg.mode, tg.plan_options = mode, dict(options)
        reason = _find_items(tg)
    if reason is None:
        try:
            rs_chunks = _rs_chunks(tg, mode, options)
            if not tg.has_extensions:
                tg.set_chunks(rs_chunks)
            else:
                tg.set_chunks(_item_chunks(tg, mode, options), rs_chunks)
            if len(rs_chunks) > 1 and len(tg.rs_items) <= MAX_PARAMS:
                # Sub-plans across chunks (a whole reduce-scatter of a mixed group) fit this.
                c0 = rs_chunks[0]
                sig = tide.GroupSignature(shapes=tg.rs_shapes, ag_dtype=_DTYPE_NAMES[c0.ag_dtype],
                                          grad_dtype="float32", shard_dtype=_DTYPE_NAMES[c0.shard_dtype],
                                          names=tuple(tg.names[p] for p, _ in tg.rs_items))
                tg.rs_bound = tide.plan(sig, tg.topology, mode=mode, **options)
        except tide.PlanError as e:
            reason = f"plan: {e}"
        else:
            tg.elements = [tg.chunk_of(i).plan.layout.params[tg.local_index[i]].e
                           for i in range(len(tg.items))]
            tg.rs_elements = [tg.rs_chunk_of(i).plan.layout.params[tg.rs_local_index[i]].e
                              for i in range(len(tg.rs_items))]
            reason = _check_rows(tg, names)
    if reason is None:
        _plan_post_forward(tg, topo, mode, options)
    if reason is not None:
        tg.fall_back(reason)


def _find_items(tg: TideGroup) -> str | None:
    """tg's RS items (one per parameter, one per row of a Shard(k > 0) parameter: tide/plan.py
    [Note: Shard(k) as rows]) and AG items (a plain parameter's RS items; one per pre-all-gather
    output of an extension parameter: extensions.py [Note: all-gather extensions]); or why tg is
    not served."""
    tg.items, tg.param_items, tg.item_dtypes, tg.extension = [], [], [], []
    tg.item_shapes, tg.shard_dims = [], []
    tg.rs_items, tg.param_rs_items, tg.rs_shapes = [], [], []
    for p, fp in enumerate(tg.pg.fsdp_params):
        dim = fp.fsdp_placement.dim
        rows, shape = 1, tg.shapes[p]
        if dim:
            try:
                rows, shape = shard_rows(tg.shapes[p], dim, tg.world)
            except tide.PlanError as e:
                return f"{tg.names[p] or p}: Shard({dim}): {e}"
        tg.shard_dims.append(dim)
        tg.param_rs_items.append(list(range(len(tg.rs_items), len(tg.rs_items) + rows)))
        tg.rs_items += [(p, a) for a in range(rows)]
        tg.rs_shapes += [shape] * rows
        ext = extensions.has_extension(fp)
        got = extensions.probe(fp, tg.world) if ext else ([shape] * rows, [tg.ag_dtypes[p]] * rows)
        if isinstance(got, str):
            return f"{tg.names[p] or p}: {got}"
        tg.extension.append(ext)
        tg.param_items.append(list(range(len(tg.items), len(tg.items) + len(got[0]))))
        for j, (shape, dtype) in enumerate(zip(*got)):
            tg.items.append((p, j))
            tg.item_shapes.append(shape)
            tg.item_dtypes.append(dtype)
    return None


def _check_rows(tg: TideGroup, names: dict[int, str]) -> str | None:
    """FSDP2's padding is the plan's (dim-0 parameters), and a Shard(k > 0) parameter's rows are
    consecutive items of one AG plan (tide/plan.py [Note: Shard(k) as rows])."""
    for p, fp in enumerate(tg.pg.fsdp_params):
        who = names.get(id(fp.sharded_param), p)
        if tg.shard_dims[p]:
            its = tg.param_items[p]
            if (len({tg.chunk_index[i] for i in its}) > 1
                    or [tg.local_index[i] for i in its] != list(range(tg.local_index[its[0]],
                                                                    tg.local_index[its[0]] + len(its)))):
                return f"{who}: Shard({tg.shard_dims[p]}): its {len(its)} rows straddle two plans"
            continue
        i = tg.param_rs_items[p][0]
        R = tg.rs_chunk_of(i).plan.layout.params[tg.rs_local_index[i]].R
        if fp.padded_sharded_param_size[0] != R:
            return f"{who}: FSDP2 pads to {fp.padded_sharded_param_size[0]} rows, the plan to {R}"
    return None


def _rs_chunks(tg: TideGroup, mode: str, options: dict[str, int]) -> list[Chunk]:
    """Plans over the RS items, one per dtype class ([Note: chunks]): a group's AG and RS
    chunks, or only its RS chunks when it has extension parameters."""
    # A chunk's gradients are planned in its all-gather dtype (what autograd produces).
    dtypes = [(_DTYPE_NAMES[tg.ag_dtypes[p]], _DTYPE_NAMES[tg.ag_dtypes[p]],
               _DTYPE_NAMES[tg.shard_dtypes[p]]) for p, _ in tg.rs_items]
    chunks = []
    for k, (params, plan) in enumerate(plan_classes(tg.rs_shapes, dtypes, tg.topology, mode,
                                                    names=[tg.names[p] for p, _ in tg.rs_items],
                                                    bundles=[p for p, _ in tg.rs_items], **options)):
        first = tg.rs_items[params[0]][0]
        c = Chunk(k, params, plan, tg.ag_dtypes[first], tg.shard_dtypes[first])
        if c.ag_dtype != torch.float32:
            # fp32 gradients (accumulated without sync in an fp32 reduce dtype, or what
            # autograd produces for fp32-computed parameters) keep TIDE-RS through a
            # second plan; it also sizes the TIDE-RS scratch that bounds every sub-plan.
            c.plan_fp32_grads = _with_grads(plan, "float32", tg.topology, mode, options)
        chunks.append(c)
    return chunks


def _item_chunks(tg: TideGroup, mode: str, options: dict[str, int]) -> list[Chunk]:
    """AG plans over the items of a group with extension parameters: plain parameters' items in
    their dtype classes as always, pre-all-gather outputs in classes of their own (read from
    the user's buffer, never adopted nor cast)."""
    plain, outputs = [], []
    for i, (p, _) in enumerate(tg.items):
        (outputs if tg.extension[p] else plain).append(i)
    pieces = []
    for members, ext in ((plain, False), (outputs, True)):
        if not members:
            continue
        dtypes = []
        for i in members:
            p = tg.items[i][0]
            if ext:
                item = extensions.item_name(tg.item_dtypes[i])
                # 1-byte items are never gradients: the (unused) gradient dtype is bf16.
                dtypes.append((item, "bfloat16" if item == "uint8" else item, item))
            else:
                dtypes.append((_DTYPE_NAMES[tg.ag_dtypes[p]], _DTYPE_NAMES[tg.ag_dtypes[p]],
                               _DTYPE_NAMES[tg.shard_dtypes[p]]))
        for sub, plan in plan_classes([tg.item_shapes[i] for i in members], dtypes, tg.topology,
                                      mode, names=[tg.names[tg.items[i][0]] for i in members],
                                      bundles=[tg.items[i][0] for i in members], **options):
            pieces.append((tuple(members[k] for k in sub), plan, ext))
    chunks = []
    for k, (items, plan, ext) in enumerate(sorted(pieces, key=lambda x: x[0])):
        first = tg.items[items[0]][0]
        ag = tg.item_dtypes[items[0]]
        chunks.append(Chunk(k, items, plan, ag, ag if ext else tg.shard_dtypes[first], extension=ext))
    return chunks


def _with_grads(plan: Any, grad_dtype: str, topo: tide.Topology, mode: str,
                options: dict[str, int]) -> Any:
    """``plan``'s parameters and dtypes with gradients in ``grad_dtype``."""
    sig = tide.GroupSignature(shapes=plan.shapes, ag_dtype=plan.ag_dtype, grad_dtype=grad_dtype,
                              shard_dtype=plan.shard_dtype, names=tuple(plan.names))
    return tide.plan(sig, topo, mode=mode, **options)


def _plan_post_forward(tg: TideGroup, topo: tide.Topology, mode: str,
                       options: dict[str, int]) -> None:
    """See [Note: post-forward mesh]. Leaves the chunks' post-forward plans None (those
    all-gathers are handed back, counted) where the group cannot take one."""
    pf = tg.pg.post_forward_mesh_info
    if tg.has_extensions or any(tg.shard_dims):
        return  # FSDP2 has no post-forward form of the extension protocol (extensions.py); a
        # Shard(k > 0) post-forward shard is cut from dim 0 (its re-gathers are handed back)
    if pf is None or pf.shard_process_group.size() in (1, tg.world):
        return
    ranks = dist.get_process_group_ranks(pf.shard_process_group)
    pf_topo = ranks_.group_topology(ranks, topo)
    plans = [regather_plan(c.plan, pf_topo, mode, **options) if pf_topo else None for c in tg.chunks]
    if all(p is not None for p in plans):
        for c, p in zip(tg.chunks, plans):
            c.plan_post_forward = p
        tg.post_forward_ranks = list(ranks)


def log_fallback(tg: TideGroup) -> None:
    logger.warning("tide_torch: group %s uses stock FSDP2 collectives: %s", tg.fqn, tg.fallback)
