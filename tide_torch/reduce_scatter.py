"""TIDE-RS face for FSDP2: per-parameter gradients reduced straight into FSDP2's RS output.

FSDP2's ``foreach_reduce`` stays in charge (divide factors, HSDP all-reduce, all-reduce hook,
accumulation into ``.grad``, post-accumulate hooks): TIDE only replaces the packing and the
collective.

1. ``foreach_reduce`` (wrapped in the param-group module's namespace) tells the group's comm
   which FSDPParams this call reduces, in FSDP2's packing order: every parameter that has a
   gradient (frozen parameters and experts that got no token have none).
2. ``TideReduceScatter.allocate`` is called first for the packed *input*: it returns a
   placeholder that owns no memory (the ``2NS``-byte ``_chunk_cat`` buffer never exists; FSDP2's
   pre-division of it is recorded and becomes part of alpha), then for the output, which is a
   real tensor in the reduce dtype.
3. ``foreach_reduce_scatter_copy_in`` (patched in ``_fsdp_collectives``) sees the placeholder and,
   instead of ``_chunk_cat``, stages the gradients on it:
   - In-Place: keeps references to autograd's per-parameter gradients;
   - Slot-Reuse: copies them into the group's vacated all-gather ring slot (same byte geometry),
     so autograd's storage is freed when FSDP2 clears its list right after.
   The call is cut into parts (see [Note: RS parts]); each part's gradients are read in place
   in their own dtype.
4. ``TideReduceScatter.__call__`` runs TIDE-RS part by part into FSDP2's output with ``alpha``
   derived from FSDP2's op: AVG -> 1/N, SUM (incl. force-sum, whose division FSDP2 applies
   afterwards) -> 1, PREMUL_SUM(1/f) for a custom divide factor f -> 1/f. A low-precision reduce
   dtype (bf16, fp16) is written once from TIDE-RS's fp32 sum (see [Note: low-precision reduce]).

[Note: RS parts]
FSDP2's output holds, in packing order, each reduced parameter's padded shard. A run of
consecutive parameters of that order with one gradient dtype (bf16, fp16 or fp32; at most 256
of them) is one TIDE-RS plan whose output is a contiguous slice of FSDP2's output, so a call is
one or more parts, each a TIDE-RS over its own gradients, read in their own dtype, into its own
slice:
- a whole chunk (groups.py [Note: chunks]; a uniform group of at most 256 parameters is one),
  gradients in its all-gather dtype: the chunk's plan (Slot-Reuse may stage a one-chunk group into
  the ring slot); in fp32 (accumulated without sync): its fp32-gradient plan;
- anything else (bf16 weights with fp32 norm gradients, a group of several dtype classes, torch
  2.15's per-parameter gradient dtypes; a subset of the group: frozen parameters, experts without
  tokens): a sub-plan, planned on first use with the group's options and kept per (parameters,
  dtype). Its counters come from the group's pool reserved at enable() (placement.py, SUB_PLANS
  ranges) and its scratch must fit the arena's TIDE-RS regions (sized for the group's
  fp32-gradient plans, or its whole-group ``rs_bound``, which bound any subset).
  Every rank reduces the same parameters in the same order (FSDP2's own contract), so every rank
  plans the same sub-plans in the same order and draws the same counter ranges.
A call no part can serve (the pool is spent, a gradient that is not contiguous) is handed to
stock FSDP2 whole, counted and logged once per group and reason (Runtime.hand_back).

[Note: low-precision reduce]
With ``reduce_dtype`` bf16 or fp16 FSDP2's output is in that dtype. TIDE-RS reads the per-parameter
gradients in their own dtype (bf16, fp16 or fp32: torch 2.15 hands them over in the reduce dtype),
widens each exactly, sums in fp32 and writes an fp32 shard; that shard is rounded into FSDP2's
output once. For fp16 FSDP2 pre-divides its packed input (overflow risk) and post-divides the
output; the pre-division of the placeholder is recorded (``_Placeholder.div_``) and folded into
alpha, where the fp32 sum needs no guard against overflow.
One rounding of the fp32 sum: never further from the exact sum than a ring that rounds after
every hop (NCCL's bf16 reduce-scatter), and equal to stock wherever stock's low-precision sum is
exact. The fp32 shard is 1/N of the gradient (the packed input stock builds is N times larger).

[Note: gradient lifetime]
The staged gradients hang off the placeholder, which FSDP2 keeps in ``ReduceScatterState`` until
the next group's ``post_backward`` waits on this reduce-scatter's event (or the root's final
callback). That is TIDE's default release point for In-Place (§5): autograd's gradients stay
live exactly as long as FSDP2 would have kept its packed copy, and no ``record_stream`` is needed.
Under Slot-Reuse the ring slot holds the gradients instead; the runtime records the
reduce-scatter's event on the slot, and the slot's next all-gather waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tide.plan import MAX_PARAMS
from tide_torch import _patches


@dataclass
class _Part:
    plan: Any                      # the TIDE-RS plan of these gradients
    which: str                     # the session key ("rs", "rs32" or a sub-plan's)
    grads: list[torch.Tensor]      # what TIDE-RS reads (None once read)
    offset: int                    # first element of the part's slice of FSDP2's output
    numel: int


@dataclass
class _Staged:
    parts: list[_Part] = field(default_factory=list)
    stock_input: torch.Tensor | None = None        # packed input when this call falls back
    in_slot: bool = False                          # Slot-Reuse: grads live in the ring slot


class HandBack(Exception):
    """This call goes to stock FSDP2; the message is the reason (counted and logged once)."""


class _Placeholder(torch.Tensor):
    """FSDP2's packed reduce-scatter input, never materialised: a meta tensor of its size. The
    in-place division FSDP2 applies to it (``_div_if_needed``: the pre-division of a reduce dtype
    with an overflow risk, fp16) is recorded and folded into TIDE-RS's alpha."""

    prediv = 1.0
    device_: torch.device

    def div_(self, other):  # noqa: D102 - see the class
        self.prediv *= float(other)
        return self


def _placeholder(size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    ph = torch.Tensor._make_subclass(_Placeholder, torch.empty(*size, dtype=dtype, device="meta"))
    ph.device_ = device
    return ph


class TideReduceScatter(_patches.ReduceScatter):
    """FSDP2 ReduceScatter comm for one TIDE group (installed as the group's
    ``_reduce_scatter_comm``; the previous comm is restored on disable)."""

    def __init__(self, tg: Any, previous: Any) -> None:
        self.tg = tg
        self.previous = previous
        self._next_is_input = True
        self.call_params: list | None = None  # set by foreach_reduce for the next call
        self.call_grads: list | None = None   # its gradients as autograd made them ([Note: Shard(k) gradients])

    def allocate(self, size, *, dtype, device):
        if self._next_is_input:
            self._next_is_input = False
            if self.tg.world == 1:
                # FSDP2 copies this input into its output itself: TIDE-RS writes it (stage()).
                ph = torch.empty(*size, dtype=dtype, device=device)
            else:
                ph = _placeholder(size, dtype, device)
            ph._tide_comm = self
            return ph
        self._next_is_input = True  # the output; at world 1 no __call__ follows
        return torch.empty(*size, dtype=dtype, device=device)

    # Called from the patched foreach_reduce_scatter_copy_in, on the compute stream.
    @torch.no_grad()
    def stage(self, unsharded_grads: list[torch.Tensor], placeholder: torch.Tensor,
              world_size: int) -> None:
        tg, rt = self.tg, self.tg.runtime
        params, self.call_params = self.call_params, None
        originals, self.call_grads = self.call_grads, None
        single = tg.world == 1  # See [Note: world 1] in groups.py
        staged = _Staged()
        try:
            grads = _shard_k_grads(tg, params, unsharded_grads, originals)
            staged.parts = self._parts(grads, params, world_size)
        except HandBack as why:
            staged.stock_input = placeholder if single else torch.empty(
                placeholder.shape, dtype=placeholder.dtype, device=placeholder.device_)
            _patches.stock(_patches._coll, "foreach_reduce_scatter_copy_in")(
                _reordered(tg, params, unsharded_grads, world_size), staged.stock_input, world_size)
            rt.hand_back(tg, "rs", str(why))
            placeholder._tide_staged = staged
            return
        first = staged.parts[0]
        if (len(staged.parts) == 1 and first.which == "rs" and len(tg.chunks) == 1
                and not tg.has_extensions  # the slot's geometry is the items', not the gradients'
                and rt.mode == "slot_reuse" and rt.slot_is_free(tg)):
            views = [lv.narrow(0, 0, g.numel()).view(g.shape)
                     for lv, g in zip(tg.landing_views, first.grads)]  # per item: its landing
            torch._foreach_copy_(views, first.grads)
            first.grads, staged.in_slot = views, True
            rt.hold_slot_for_grads(tg)
        placeholder._tide_staged = staged
        if not single:
            rt.issue_early_all_gather(tg)  # See [Note: early backward all-gather] (runtime.py)
            return
        # N = 1: TIDE-RS writes FSDP2's packed input (which FSDP2 copies into its output and
        # divides by any divide factor itself), on the compute stream, alpha = 1.
        self._run(staged, placeholder, 1.0)

    def _parts(self, grads: list[torch.Tensor], params: list | None, world_size: int) -> list[_Part]:
        """See [Note: RS parts]. Raises HandBack when the call cannot run through TIDE."""
        tg = self.tg
        if world_size != tg.world:
            raise HandBack(f"reduce-scatter over {world_size} ranks, planned for {tg.world}")
        if params is None:  # FSDP2 reached the copy-in without foreach_reduce's wrapper
            if len(grads) != len(tg.shapes):
                raise HandBack("the call's parameters are unknown (foreach_reduce not seen)")
            index = list(range(len(grads)))
        else:
            index = [tg.param_index[id(fp)] for fp in params]
        for p, g in zip(index, grads):
            if tuple(g.shape) != tg.shapes[p]:
                raise HandBack(f"parameter {tg.names[p]}: gradient shape {tuple(g.shape)}, "
                               f"planned {tg.shapes[p]}")
            if not g.is_contiguous():
                raise HandBack(f"parameter {tg.names[p]}: gradient is not contiguous")
            if type(g) is not torch.Tensor:
                raise HandBack(f"parameter {tg.names[p]}: gradient is a {type(g).__name__}")
        # Per RS item: a parameter's gradient, or a Shard(k > 0) parameter's rows (tide/plan.py
        # [Note: Shard(k) as rows]): row a of the unsharded gradient, read in place.
        items, item_grads = [], []
        for p, g in zip(index, grads):
            its = tg.param_rs_items[p]
            items += its
            item_grads += [g] if len(its) == 1 else list(g.view(len(its), -1))
        index, grads = items, item_grads
        parts: list[_Part] = []
        offset = 0
        start = 0
        while start < len(grads):
            end = start + 1
            while (end < len(grads) and end - start < MAX_PARAMS
                   and grads[end].dtype == grads[start].dtype):
                end += 1
            plan, which = tg.rs_plan(tuple(index[start:end]), grads[start].dtype)
            numel = sum(tg.rs_elements[i] for i in index[start:end])
            parts.append(_Part(plan, which, list(grads[start:end]), offset, numel))
            offset += numel
            start = end
        return parts

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self._next_is_input = True
        staged: _Staged | None = getattr(input_tensor, "_tide_staged", None)
        if staged is None:
            raise AssertionError("TideReduceScatter called without staged gradients "
                                 f"(group {self.tg.fqn})")
        prediv = getattr(input_tensor, "prediv", 1.0)  # FSDP2's pre-division (_Placeholder)
        if staged.stock_input is not None:
            if prediv != 1.0:
                staged.stock_input.div_(prediv)
            return dist.reduce_scatter_tensor(output_tensor, staged.stock_input, op=op,
                                              group=group, async_op=async_op)
        self._run(staged, output_tensor, self.alpha(op, group) / prediv)
        return None

    def _run(self, staged: _Staged, output: torch.Tensor, alpha: float) -> None:
        """TIDE-RS of every part into its slice of ``output`` (on the current stream)."""
        tg, rt = self.tg, self.tg.runtime
        # See [Note: low-precision reduce]: the fp32 shard, rounded into the output once.
        out32 = output if output.dtype == torch.float32 else torch.empty(
            output.shape, dtype=torch.float32, device=output.device)
        for part in staged.parts:
            target = out32 if part.numel == out32.numel() else out32.narrow(0, part.offset, part.numel)
            rt.transport.reduce_scatter(tg, part.plan, part.which, part.grads, target, alpha)
            if tg.world == 1:
                # Read on the compute stream, where autograd made them: their storage may go
                # now. Otherwise the placeholder keeps them (see [Note: gradient lifetime]).
                part.grads = None
        if out32 is not output:
            output.copy_(out32)
        if staged.in_slot:
            rt.release_slot_after_rs(tg)
        rt.stats["rs_tide"] += 1

    def alpha(self, op: Any, group: Any) -> float:
        if isinstance(op, dist.ReduceOp.RedOpType):
            if op == dist.ReduceOp.AVG:
                return 1.0 / group.size()
            if op == dist.ReduceOp.SUM:
                return 1.0
            raise NotImplementedError(f"TIDE-RS: reduce op {op}")
        # PREMUL_SUM built by FSDP2 from the group's gradient divide factor.
        factor = self.tg.pg.gradient_divide_factor
        if factor is None:
            raise NotImplementedError(f"TIDE-RS: reduce op {op} without a divide factor")
        return 1.0 / factor


def foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size):
    comm = getattr(reduce_scatter_input, "_tide_comm", None)
    if comm is None:
        return _patches.stock(_patches._coll, "foreach_reduce_scatter_copy_in")(
            unsharded_grads, reduce_scatter_input, world_size)
    comm.stage(unsharded_grads, reduce_scatter_input, world_size)


def _shard_k_grads(tg: Any, params: list | None, grads: list, originals: list | None) -> list:
    """The gradients TIDE-RS reads: a Shard(k > 0) parameter's as autograd made it (see
    [Note: Shard(k) gradients])."""
    if params is None or originals is None or not any(tg.shard_dims):
        return grads
    return [o if tg.shard_dims[tg.param_index[id(fp)]] else g
            for fp, g, o in zip(params, grads, originals)]


def _reordered(tg: Any, params: list | None, grads: list, world: int) -> list:
    """For stock's copy-in: a Shard(k > 0) gradient FSDP2 left unordered (torch 2.15 under
    TIDE's input hook) gets FSDP2's dim-0 reorder."""
    if params is None or not any(tg.shard_dims):
        return grads
    out = []
    for fp, g in zip(params, grads):
        k = tg.shard_dims[tg.param_index[id(fp)]]
        out.append(torch.cat(torch.chunk(g, world, dim=k), dim=0)
                   if k and tuple(g.shape) == tuple(fp._orig_size) else g)
    return out


# [Note: Shard(k) gradients]
# FSDP2 reorders a Shard(k > 0) gradient into dim-0 rank-major order before packing (torch.cat of
# its N column blocks). TIDE-RS instead reads the gradient as autograd made it, by rows (tide/
# plan.py [Note: Shard(k) as rows]): ``foreach_reduce`` below hands the comm the call's gradient
# list before FSDP2 touches it. On torch 2.15 the reorder is the group's
# ``prepare_reduce_scatter_inputs``, replaced here by one that only reports the sizes (no copy);
# on 2.11 it is inline in ``foreach_reduce``: FSDP2's reordered copy is made and left unread.
def _sizes_only(fsdp_params, unsharded_grads, world_size):
    """FSDP2's padded dim-0 sizes of the reordered gradients, without reordering them."""
    sizes = []
    for fp, g in zip(fsdp_params, unsharded_grads):
        shape = list(g.size())
        if (k := fp.fsdp_placement.dim) and world_size > 1:
            shape[0] *= world_size
            shape[k] //= world_size
        sizes.append(_patches._coll._get_dim0_padded_size(torch.Size(shape), world_size))
    return tuple(sizes)


def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_scatter_comm, *args, **kwargs):
    """FSDP2's foreach_reduce, telling a TIDE group's comm which parameters the call reduces (and
    their gradients as autograd made them: [Note: Shard(k) gradients])."""
    if isinstance(reduce_scatter_comm, TideReduceScatter):
        reduce_scatter_comm.call_params = list(fsdp_params)
        if any(reduce_scatter_comm.tg.shard_dims):
            reduce_scatter_comm.call_grads = list(unsharded_grads)
            default = getattr(_patches._coll, "_default_reduce_scatter_input_fn", None)
            if kwargs.get("prepare_reduce_scatter_inputs", None) is default is not None:
                kwargs["prepare_reduce_scatter_inputs"] = _sizes_only
    return _patches.stock(_patches._pg, "foreach_reduce")(
        fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
        reduce_scatter_comm, *args, **kwargs)


foreach_reduce_scatter_copy_in._tide_hook = True
foreach_reduce._tide_hook = True
