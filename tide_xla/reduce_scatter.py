"""ReduceScatterPrimitive: one TIDE-RS FFI call per group (target "tide_reduce_scatter").

bf16 gradients (D_p, ...) in, the group's packed fp32 shard out: E = sum_p R_p K_p elements with
parameter p at prefix offset o32_p = sum_{q<p} R_q K_q, the per-rank output TIDE-RS writes (the
reduce-scatter JAX lacks: jax#27496). With `accumulate`, a packed fp32 shard is added in place:
it is aliased to the result (input_output_aliases), so a donated accumulator is updated without
a copy.

Names carried through the layers: ReduceScatterImpl / ReduceScatterHandler
(ffi/reduce_scatter.cc) -> target "tide_reduce_scatter" -> ReduceScatterPrimitive.name here.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import tide
from tide_xla.all_gather import next_op_id
from tide_xla.context import TideContext


def unpack(packed: jax.Array, shapes: Sequence[Sequence[int]], world: int) -> list[jax.Array]:
    """A local packed fp32 shard -> one (R_p, ...) shard per parameter (slices of `packed`)."""
    return [packed[p.o32:p.o32 + p.e].reshape(p.R, *s[1:])
            for p, s in zip(tide.layout(shapes, world).params, shapes)]


class ReduceScatterPrimitive:
    """P gradients (D_p, ...) [+ packed fp32 accumulator] -> packed fp32 shard (E,)."""

    name = "tide_reduce_scatter"

    @staticmethod
    def abstract(grads: Sequence[jax.ShapeDtypeStruct], world: int) -> jax.ShapeDtypeStruct:
        e = tide.layout([g.shape for g in grads], world).E
        return jax.ShapeDtypeStruct((e,), jnp.float32)

    @classmethod
    def bind(cls, ctx: TideContext, grads: Sequence[jax.Array], *, scale: float = 1.0,
             accumulate: jax.Array | None = None) -> jax.Array:
        out_type = cls.abstract(grads, ctx.world)
        operands = list(grads)
        aliases = None
        if accumulate is not None:
            if accumulate.shape != out_type.shape or accumulate.dtype != jnp.float32:
                raise ValueError(f"{cls.name}: the accumulator {accumulate.shape} "
                                 f"{accumulate.dtype} must be the group's packed float32 shard "
                                 f"of shape {out_type.shape}")
            operands.append(accumulate)
            aliases = {1 + len(grads): 0}  # operand 0 is `where`
        if not ctx.served:  # N = 1 kept stock: the packed cast ([Note: world 1] in context.py)
            packed = jnp.concatenate([jnp.ravel(g).astype(jnp.float32) for g in grads]) * np.float32(scale)
            return packed if accumulate is None else accumulate + packed
        if ctx.spans_processes:  # agree the call and open the rank states on every process
            from tide_xla import processes
            processes.prepare(ctx, cls.name, [g.shape for g in grads], grads[0].dtype,
                              grads[0].dtype)
        call = jax.ffi.ffi_call(cls.name, out_type, vmap_method="sequential",
                                input_output_aliases=aliases)
        return call(ctx.where(), *operands, dims0=np.asarray([g.shape[0] for g in grads], np.int64),
                    scale=np.float32(scale), accumulate=np.int64(accumulate is not None),
                    **ctx.attrs(next_op_id()))
