"""ReduceScatterPrimitive: one TIDE-RS FFI call per group (target "tide_reduce_scatter").

bf16 gradients (D_p, ...) in, fp32 shards (R_p, ...) out: the reduce-scatter JAX lacks
(jax#27496). With `accumulate`, P fp32 shards are added in place: they are aliased to the results
(input_output_aliases), so a donated accumulator is updated without a copy.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tide_xla.all_gather import next_op_id
from tide_xla.context import TideContext


class ReduceScatterPrimitive:
    """P gradients (D_p, ...) [+ P fp32 accumulators] -> P fp32 shards (R_p, ...)."""

    name = "tide_reduce_scatter"

    @staticmethod
    def abstract(grads: Sequence[jax.ShapeDtypeStruct], world: int):
        return [jax.ShapeDtypeStruct((-(-g.shape[0] // world), *g.shape[1:]), jnp.float32)
                for g in grads]

    @classmethod
    def bind(cls, ctx: TideContext, grads: Sequence[jax.Array], *, scale: float = 1.0,
             accumulate: Sequence[jax.Array] | None = None):
        p = len(grads)
        out_types = cls.abstract(grads, ctx.world)
        operands = list(grads)
        aliases = None
        if accumulate is not None:
            if len(accumulate) != p:
                raise ValueError(f"{cls.name}: {len(accumulate)} accumulators for {p} gradients")
            for a, t in zip(accumulate, out_types):
                if a.shape != t.shape or a.dtype != jnp.float32:
                    raise ValueError(f"{cls.name}: accumulator {a.shape} {a.dtype} must be a "
                                     f"float32 shard of shape {t.shape}")
            operands += list(accumulate)
            aliases = {p + i: i for i in range(p)}
        call = jax.ffi.ffi_call(cls.name, out_types, vmap_method="sequential",
                                input_output_aliases=aliases)
        return call(*operands, dims0=np.asarray([g.shape[0] for g in grads], np.int64),
                    scale=np.float32(scale), accumulate=np.int64(accumulate is not None),
                    **ctx.attrs(next_op_id()))
