"""AllGatherPrimitive: one TIDE-AG FFI call per group (target "tide_all_gather").

Names carried through the layers: AllGatherImpl / AllGatherHandler (ffi/all_gather.cc) ->
target "tide_all_gather" -> AllGatherPrimitive.name here.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import jax
import numpy as np

from tide_xla.context import TideContext

# Call-site ids: fixed at trace time, equal on every device (one SPMD program), distinct per
# call site. The handler's rendezvous key is (RunId, group, op_id, seq).
_op_ids = itertools.count(1)


def next_op_id() -> int:
    return next(_op_ids)


class AllGatherPrimitive:
    """P shards (R_p, ...) -> P parameters (D_p, ...), on one device inside shard_map."""

    name = "tide_all_gather"

    @staticmethod
    def abstract(shards: Sequence[jax.ShapeDtypeStruct], dims0: Sequence[int], ag_dtype):
        return [jax.ShapeDtypeStruct((d, *s.shape[1:]), ag_dtype) for s, d in zip(shards, dims0)]

    @classmethod
    def bind(cls, ctx: TideContext, shards: Sequence[jax.Array], dims0: Sequence[int], ag_dtype):
        if not ctx.served:  # N = 1 kept stock: the cast ([Note: world 1] in context.py)
            return [s.astype(ag_dtype) for s in shards]
        out_types = cls.abstract(shards, dims0, ag_dtype)
        if ctx.spans_processes:  # agree the call and open the rank states on every process
            from tide_xla import processes
            processes.prepare(ctx, cls.name, [o.shape for o in out_types], shards[0].dtype,
                              ag_dtype)
        call = jax.ffi.ffi_call(cls.name, out_types, vmap_method="sequential")
        return call(ctx.where(), *shards, dims0=np.asarray(dims0, np.int64),
                    **ctx.attrs(next_op_id()))
