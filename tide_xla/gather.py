"""`gather` (custom_vjp: TIDE-AG forward, TIDE-RS backward) and `reduce_scatter` on trees.

Both run on one device's local shards inside `jax.shard_map` over the layout's mesh.

[Note: device-varying outputs] An ffi_call result is typed device-invariant under check_vma, so
JAX would psum its cotangent over the FSDP axis before our backward sees it and the gradients
would come out N times too large. Forward results are therefore marked varying
(`jax.lax.pcast(..., to="varying")`) over every manual axis of the shard_map, so the cotangent
reaches TIDE-RS unreduced; TIDE-RS results are marked varying likewise. A shard that is invariant
in some axis (the `data` axis of an fsdp x data mesh: replicas that share a shard) then gets its
fp32 RS result summed over that axis (HSDP's replica all-reduce after the shard-group RS, as FSDP2
orders them). With check_vma off nothing is typed and nothing is added: as with
jax.lax.all_gather, reducing over replica axes is then the caller's job.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tide

from tide_xla.all_gather import AllGatherPrimitive
from tide_xla.context import TideContext, context_for
from tide_xla.reduce_scatter import ReduceScatterPrimitive, unpack
from tide_xla.sharding import ShardLayout


def _vma(x) -> frozenset:
    """Mesh axes `x` varies over (empty when check_vma is off). jax 0.11 names it
    aval.manual_axis_type.varying; older releases aval.vma."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _mark_varying(x, axes: frozenset):
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _manual_axes() -> frozenset:
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def _check_mesh(layout: ShardLayout) -> None:
    """gather/reduce_scatter must run inside shard_map over the layout's mesh axis."""
    am = jax.sharding.get_abstract_mesh()
    want = dict(layout.mesh.shape)
    if am is None or am.empty:
        raise ValueError(f"tide_xla: call gather/reduce_scatter inside jax.shard_map over a mesh "
                         f"{want} (axis {layout.axis!r}); no mesh is in context here")
    have = dict(am.shape)
    if have != want:
        raise ValueError(f"tide_xla: mesh mismatch: the parameters were sharded for mesh {want} "
                         f"but this shard_map runs over {have}")
    manual = getattr(am, "manual_axes", None)
    if manual is not None and layout.axis not in manual:
        raise ValueError(f"tide_xla: axis {layout.axis!r} is not manual here; call gather inside "
                         f"jax.shard_map over it (manual axes: {tuple(manual)})")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _gather_group(ctx: TideContext, dims0: tuple, ag_dtype: Any, scale: float, shard_dtype: Any,
                  shard_vma: tuple, shards: tuple):
    out, _ = _gather_group_fwd(ctx, dims0, ag_dtype, scale, shard_dtype, shard_vma, shards)
    return out


def _gather_group_fwd(ctx, dims0, ag_dtype, scale, shard_dtype, shard_vma, shards):
    # Shards vary over the FSDP axis whenever check_vma is on; no vma at all means it is off.
    axes = _manual_axes() if shard_vma[0] else frozenset()
    outs = AllGatherPrimitive.bind(ctx, shards, dims0, ag_dtype)
    return tuple(_mark_varying(o, axes) for o in outs), None


def _gather_group_bwd(ctx, dims0, ag_dtype, scale, shard_dtype, shard_vma, _, cts):
    cts = tuple(jnp.asarray(c, ag_dtype) for c in cts)
    packed = ReduceScatterPrimitive.bind(ctx, cts, scale=scale)
    if shard_vma[0]:  # check_vma on: see [Note: device-varying outputs]
        packed = _mark_varying(packed, frozenset().union(*(_vma(c) for c in cts)))
        extra = tuple(sorted(_vma(packed) - frozenset.intersection(*shard_vma)))
        if extra:
            packed = jax.lax.psum(packed, extra)
    grads = unpack(packed, [c.shape for c in cts], ctx.world)
    return (tuple(g.astype(shard_dtype) for g in grads),)


_gather_group.defvjp(_gather_group_fwd, _gather_group_bwd)


def _scale(value, name: str, what: str) -> float:
    """A static scale: a finite real number (not a bool, a string or a traced value)."""
    import math
    import numbers
    concrete0d = (isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0
                  and not isinstance(value, jax.core.Tracer)
                  and jnp.issubdtype(value.dtype, jnp.number))
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or concrete0d):
        raise TypeError(f"tide_xla.{what}: {name} must be a finite number (static: the plan's "
                        f"scale), got {type(value).__name__} {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"tide_xla.{what}: {name} must be a finite number, got {value!r}")
    return float(value)


def _local_leaves(layout: ShardLayout, tree, what: str, expect_rows: bool):
    """The tree's leaves in layout order, each checked for its local shape and its dtype: shards
    in `layout.shard_dtype` (gather), gradients in `layout.ag_dtype` (reduce_scatter). A leaf of
    another dtype is refused, never cast (TIDE never rounds an input)."""
    flat = layout.treedef.flatten_up_to(tree)
    dtype, role = (layout.shard_dtype, "shard_dtype") if expect_rows else (layout.ag_dtype, "ag_dtype")
    for x, l in zip(flat, layout.leaves):
        if jnp.dtype(x.dtype) != jnp.dtype(dtype):
            raise ValueError(f"tide_xla.{what}: leaf {l.path} has dtype {x.dtype}, expected the layout's "
                             f"{role} {jnp.dtype(dtype)} (convert it yourself: TIDE never rounds an input)")
        want = (l.rows, *l.shape[1:]) if expect_rows else l.shape
        if tuple(x.shape) != want:
            hint = (" (inside shard_map each device sees its (R_p, ...) shard; were the "
                    "in_specs P(axis) for this leaf?)" if expect_rows else "")
            raise ValueError(f"tide_xla.{what}: leaf {l.path} has local shape {tuple(x.shape)}, "
                             f"expected {want}{hint}")
    return flat


def gather(shards, layout: ShardLayout, *, grad_scale: float = 1.0):
    """Local shards (inside shard_map) -> the full parameter tree in `layout.ag_dtype`.

    One TIDE-AG call per group. Differentiable: the backward is one TIDE-RS call per group,
    reducing the ag-dtype (bf16) gradients of every rank into fp32 shards, times `grad_scale`
    (1.0 = sum, as the transpose of jax.lax.all_gather; 1/N averages).
    """
    grad_scale = _scale(grad_scale, "grad_scale", "gather")
    _check_mesh(layout)
    ctx = context_for(layout.mesh, layout.axis)
    flat = _local_leaves(layout, shards, "gather", expect_rows=True)
    out = [None] * len(flat)
    for grp in layout.groups:
        dims0 = tuple(layout.leaves[i].shape[0] for i in grp.leaves)
        shards_g = tuple(flat[i] for i in grp.leaves)
        res = _gather_group(ctx, dims0, layout.ag_dtype, float(grad_scale), layout.shard_dtype,
                            tuple(_vma(s) for s in shards_g), shards_g)
        for i, r in zip(grp.leaves, res):
            out[i] = r
    return jax.tree_util.tree_unflatten(layout.treedef, out)


def copy_out_bytes(layout: ShardLayout) -> dict[str, int]:
    """{group name: bytes} that each device's TIDE-AG call of the group copies from its arena
    landing into XLA's results: 0 where the group lands in XLA's results directly by pulling (fp32
    shards cast to the AG dtype, on any number of nodes: [Note: pull landing] in tide/program.h),
    else (shards in the AG dtype) its unsharded parameters (docs/xla.md). Needs tide_xla.init()
    for the layout's mesh."""
    import numpy as np

    from tide_xla._registration import ffi_module
    from tide_xla.context import MODES
    ctx = context_for(layout.mesh, layout.axis)
    out = {}
    for grp in layout.groups:
        shapes = [list(layout.leaves[i].shape) for i in grp.leaves]
        info = ffi_module().group_plan("tide_all_gather", shapes, np.dtype(layout.shard_dtype).name,
                                       np.dtype(layout.ag_dtype).name, ctx.nodes, ctx.gpus_per_node,
                                       MODES[ctx.mode])
        nbytes = sum(int(np.prod(s)) for s in shapes) * np.dtype(layout.ag_dtype).itemsize
        out[grp.name] = 0 if info["pull_landing"] else nbytes
    return out


def reduce_scatter(grads, layout: ShardLayout, *, scale: float = 1.0, accumulate=None):
    """Full gradients (inside shard_map) -> one packed fp32 shard per group (a list, in
    `layout.groups` order), one TIDE-RS call per group; `unpack_grads` turns it into the tree.

    accumulate: the packed list of a previous call (or `zeros_packed` inside shard_map) to add to:
    out = accumulate + scale * sum over ranks. Each buffer is aliased to its result; donate the
    accumulators to the jitted step (donate_argnums) and the accumulation happens in place.
    """
    scale = _scale(scale, "scale", "reduce_scatter")
    _check_mesh(layout)
    ctx = context_for(layout.mesh, layout.axis)
    flat = _local_leaves(layout, grads, "reduce_scatter", expect_rows=False)
    if accumulate is not None and len(accumulate) != len(layout.groups):
        raise ValueError(f"tide_xla.reduce_scatter: {len(accumulate)} accumulators for "
                         f"{len(layout.groups)} groups")
    out = []
    for g, grp in enumerate(layout.groups):
        gs = tuple(jnp.asarray(flat[i], layout.ag_dtype) for i in grp.leaves)
        res = ReduceScatterPrimitive.bind(
            ctx, gs, scale=scale, accumulate=None if accumulate is None else accumulate[g])
        want = frozenset().union(*(_vma(x) for x in gs))
        out.append(_mark_varying(res, want | {ctx.axis}) if want else res)
    return out


def packed_sizes(layout: ShardLayout) -> list[int]:
    """E_g = sum_p R_p K_p of every group: the length of its local packed fp32 shard."""
    return [tide.layout([layout.leaves[i].shape for i in grp.leaves], layout.world).E
            for grp in layout.groups]


def zeros_packed(layout: ShardLayout):
    """Global zero accumulators for reduce_scatter(accumulate=...): one (N E_g,) fp32 array per
    group, sharded P(axis) (each rank holds its E_g)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    sh = NamedSharding(layout.mesh, P(layout.axis))
    return [jax.device_put(jnp.zeros((layout.world * e,), jnp.float32), sh)
            for e in packed_sizes(layout)]


def unpack_grads(packed, layout: ShardLayout):
    """Local packed fp32 shards (inside shard_map) -> the fp32 shard tree of `layout`."""
    out = [None] * len(layout.leaves)
    for grp, buf in zip(layout.groups, packed):
        shapes = [layout.leaves[i].shape for i in grp.leaves]
        for i, x in zip(grp.leaves, unpack(buf, shapes, layout.world)):
            out[i] = x
    return jax.tree_util.tree_unflatten(layout.treedef, out)
