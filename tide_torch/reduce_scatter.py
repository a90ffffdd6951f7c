"""TIDE-RS face for FSDP2: per-parameter gradients reduced straight into FSDP2's fp32 RS output.

FSDP2's ``foreach_reduce`` stays in charge (divide factors, HSDP all-reduce, all-reduce hook,
accumulation into ``.grad``, post-accumulate hooks): TIDE only replaces the packing and the
collective.

1. ``TideReduceScatter.allocate`` is called first for the packed fp32 *input*: it returns a
   placeholder that owns no memory (the ``2NS``-byte ``_chunk_cat`` buffer never exists), then
   for the output, which is a real fp32 tensor.
2. ``foreach_reduce_scatter_copy_in`` (patched in ``_fsdp_collectives``) sees the placeholder and,
   instead of ``_chunk_cat``, stages the gradients on it:
   - In-Place: keeps references to autograd's per-parameter gradients;
   - Slot-Reuse: copies them into the group's vacated all-gather ring slot (same byte geometry),
     so autograd's storage is freed when FSDP2 clears its list right after.
   Gradients accumulated without sync arrive in fp32 and use the group's fp32-gradient plan
   (read in place: they do not fit the bf16 slot); gradients that match neither plan (a frozen
   subset of the group) keep FSDP2's packing for that call.
3. ``TideReduceScatter.__call__`` runs TIDE-RS from the staged gradients into the output with
   ``alpha`` derived from FSDP2's op: AVG -> 1/N, SUM (incl. force-sum, whose division FSDP2
   applies afterwards) -> 1, PREMUL_SUM(1/f) for a custom divide factor f -> 1/f.

[Note: gradient lifetime]
The staged gradients hang off the placeholder, which FSDP2 keeps in ``ReduceScatterState`` until
the next group's ``post_backward`` waits on this reduce-scatter's event (or the root's final
callback). That is TIDE's default release point for In-Place (§5): autograd's gradients stay
live exactly as long as FSDP2 would have kept its packed copy, and no ``record_stream`` is needed.
Under Slot-Reuse the ring slot holds the gradients instead; the runtime records the
reduce-scatter's event on the slot, and the slot's next all-gather waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tide_torch import _patches


@dataclass
class _Staged:
    grads: list[torch.Tensor] | None = None        # what TIDE-RS reads
    plan: Any = None                               # the plan matching the gradients' dtype
    stock_input: torch.Tensor | None = None        # packed input when this call falls back
    in_slot: bool = False                          # Slot-Reuse: grads live in the ring slot


def _placeholder(size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = 1
    for s in size:
        n *= int(s)
    return torch.empty(1, dtype=dtype, device=device).expand(n)


class TideReduceScatter(_patches.ReduceScatter):
    """FSDP2 ReduceScatter comm for one TIDE group (installed as the group's
    ``_reduce_scatter_comm``; the previous comm is restored on disable)."""

    def __init__(self, tg: Any, previous: Any) -> None:
        self.tg = tg
        self.previous = previous
        self._next_is_input = True

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
        staged = _Staged(plan=self._plan_for(unsharded_grads, world_size))
        single = tg.world == 1  # See [Note: world 1] in groups.py
        if staged.plan is None:
            # e.g. frozen parameters (a subset of the group), or fp32 grads accumulated without
            # sync: this call keeps FSDP2's packing and collective.
            staged.stock_input = placeholder if single else torch.empty(
                placeholder.shape, dtype=placeholder.dtype, device=placeholder.device)
            _patches.stock(_patches._coll, "foreach_reduce_scatter_copy_in")(
                unsharded_grads, staged.stock_input, world_size)
            rt.stats["rs_stock"] += 1
        elif (rt.mode == "slot_reuse" and staged.plan is tg.plan  # fp32 grads outgrow the slot
              and rt.slot_is_free(tg)):
            views = [lv.narrow(0, 0, g.numel()).view(g.shape)
                     for lv, g in zip(tg.landing_views, unsharded_grads)]
            torch._foreach_copy_(views, unsharded_grads)
            staged.grads, staged.in_slot = views, True
            rt.hold_slot_for_grads(tg)
        else:
            staged.grads = list(unsharded_grads)  # See [Note: gradient lifetime]
        placeholder._tide_staged = staged
        if staged.stock_input is None and not single:
            rt.issue_early_all_gather(tg)  # See [Note: early backward all-gather] (runtime.py)
        if single and staged.stock_input is None:
            # N = 1: TIDE-RS writes FSDP2's packed input (which FSDP2 copies into its output and
            # divides by any divide factor itself), on the compute stream, alpha = 1.
            rt.transport.reduce_scatter(tg, staged.plan, staged.grads, placeholder, 1.0)
            if staged.in_slot:
                rt.release_slot_after_rs(tg)
            staged.grads = None  # read on this stream: autograd's storage may go now
            rt.stats["rs_tide"] += 1

    def _plan_for(self, grads: list[torch.Tensor], world_size: int) -> Any:
        """The group's plan for these gradients (bf16 from autograd, or fp32 accumulated without
        sync), or None when they do not match the group (e.g. frozen parameters)."""
        tg = self.tg
        if world_size != tg.world or len(grads) != len(tg.shapes):
            return None
        if not all(tuple(g.shape) == s and g.is_contiguous() for g, s in zip(grads, tg.shapes)):
            return None
        dtypes = {g.dtype for g in grads}
        if dtypes == {tg.param_dtype}:
            return tg.plan
        if dtypes == {tg.reduce_dtype} and tg.plan_fp32_grads is not None:
            return tg.plan_fp32_grads
        return None

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self._next_is_input = True
        staged: _Staged | None = getattr(input_tensor, "_tide_staged", None)
        if staged is None:
            raise AssertionError("TideReduceScatter called without staged gradients "
                                 f"(group {self.tg.fqn})")
        if staged.stock_input is not None:
            return dist.reduce_scatter_tensor(output_tensor, staged.stock_input, op=op,
                                              group=group, async_op=async_op)
        rt = self.tg.runtime
        rt.transport.reduce_scatter(self.tg, staged.plan, staged.grads, output_tensor,
                                    self.alpha(op, group))
        if staged.in_slot:
            rt.release_slot_after_rs(self.tg)
        rt.stats["rs_tide"] += 1
        return None

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


foreach_reduce_scatter_copy_in._tide_hook = True
