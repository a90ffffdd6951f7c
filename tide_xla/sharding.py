"""`tide_xla.shard`: dim-0 sharding padded as FSDP2 pads, and TIDE groups of leaves.

Every leaf of shape (D_p, ...) becomes a global array of shape (N * R_p, ...) with
R_p = ceil(D_p / N), sharded over the mesh axis on dim 0 (rank r holds rows [r R_p, (r+1) R_p));
the N R_p - D_p padding rows are zero, as FSDP2 pads them. Leaves are grouped into TIDE groups
(one per module or layer, at most 256 parameters each); one group = one FFI call.

`unshard(shards, layout)` is the reverse: the original tree (padding rows dropped, the dtypes
`shard` was given), and `shard` accepts it: `unshard(shard(p)) == p` bit for bit. `shard` of
`jax.ShapeDtypeStruct` leaves gives the sharded tree's shapes and shardings without memory (a
checkpoint restore target; docs/xla.md, "Checkpoints and export").
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tide

MAX_GROUP_PARAMS = 256  # tide::kMaxParams
# The dtypes TIDE's programs move (shards and gathered parameters; ffi/module.cc refuses others).
DTYPES = ("float32", "bfloat16", "float16")


def _dtype_arg(name: str, value: Any) -> np.dtype:
    """shard()'s ``shard_dtype`` / ``ag_dtype``, refused unless TIDE moves it."""
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise ValueError(f"shard: {name}={value!r} is not a dtype (expected one of "
                         f"{', '.join(DTYPES)})") from None
    if dt.name not in DTYPES:
        raise ValueError(f"shard: {name} {dt.name} is not supported: TIDE's shards and gathered "
                         f"parameters are {', '.join(DTYPES)} (floating dtypes TIDE-AG/RS move)")
    return dt


def _leaf_dtype(x: Any, name: str) -> np.dtype:
    """A leaf's own dtype (before JAX canonicalises it: float64 with x64 off stays float64),
    refused naming the leaf unless it is floating."""
    dt = getattr(x, "dtype", None)
    try:
        dt = np.dtype(dt) if dt is not None else np.asarray(x).dtype
    except (TypeError, ValueError) as e:
        raise ValueError(f"shard: leaf {name} ({type(x).__name__}) has no array dtype ({e}); "
                         f"only floating parameters are sharded") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"shard: leaf {name} has dtype {dt}; only floating parameters are "
                         f"sharded")
    return dt


def _narrowed(dt: np.dtype, into: np.dtype) -> bool:
    """Whether a leaf of a dtype TIDE does not move (float64) loses values in the ``into``
    shards, or JAX cannot hold it at all (float64 with x64 off). A leaf of a TIDE dtype cast to
    narrower shards (float32 leaves, ``shard_dtype=bfloat16``) is the caller's explicit choice."""
    if jnp.dtype(jnp.result_type(np.zeros((), dt))) != dt:  # canonicalised (x64 off)
        return True
    a, b = jnp.finfo(dt), jnp.finfo(into)
    return dt.name not in DTYPES and (a.nmant > b.nmant or a.maxexp > b.maxexp
                                      or a.minexp < b.minexp)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    path: str                 # jax.tree_util.keystr of the leaf
    shape: tuple[int, ...]    # unsharded shape (D_p, ...)
    rows: int                 # R_p = ceil(D_p / N)
    group: int                # index into ShardLayout.groups
    dtype: Any = None         # the dtype shard() was given (unshard's default)


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """One TIDE group of a ShardLayout: the leaves its collectives gather and reduce together."""

    name: str
    leaves: tuple[int, ...]   # indices into ShardLayout.leaves (flattened tree order)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardLayout:
    """How a parameter tree was sharded: static, shared by shard(), gather() and unshard()."""

    mesh: Mesh
    axis: str
    world: int                            # N
    treedef: Any
    leaves: tuple[LeafLayout, ...]
    groups: tuple[ShardGroup, ...]
    shard_dtype: Any                      # dtype of the sharded (master) leaves
    ag_dtype: Any                         # dtype of gathered parameters (and their gradients)

    @property
    def specs(self):
        """shard_map in/out specs for the sharded tree: P(axis) on every leaf."""
        return jax.tree_util.tree_unflatten(self.treedef, [P(self.axis)] * len(self.leaves))

    @property
    def sharding(self):
        return jax.tree_util.tree_unflatten(
            self.treedef, [NamedSharding(self.mesh, P(self.axis))] * len(self.leaves))

    def unshard(self, sharded, dtype=None):
        """``unshard(sharded, self, dtype=dtype)``."""
        return unshard(sharded, self, dtype=dtype)


def unshard(shards, layout: ShardLayout, *, dtype=None):
    """Global padded shards (or any tree of the same shapes: an optax moment) -> the unsharded
    tree: leaf p's rows [0, D_p), padding rows dropped, replicated over the layout's mesh (every
    process holds it whole: np.asarray works on each), in `dtype` (None: the dtype each leaf had
    when `shard` was given it, so `unshard(shard(p)) == p` bit for bit). Every process of a mesh
    that spans processes calls it (it is one jitted program)."""
    flat = layout.treedef.flatten_up_to(shards)
    rep = NamedSharding(layout.mesh, P())
    out = []
    for x, l in zip(flat, layout.leaves):
        want = (layout.world * l.rows, *l.shape[1:])
        if tuple(x.shape) != want:
            raise ValueError(f"unshard: leaf {l.path} has shape {tuple(x.shape)}, expected the "
                             f"layout's padded {want} (N R_p rows)")
        to = jnp.dtype(dtype if dtype is not None else (l.dtype or x.dtype))
        out.append(_unpad(rep, l.shape[0], to)(x))
    return jax.tree_util.tree_unflatten(layout.treedef, out)


@functools.lru_cache(maxsize=None)
def _unpad(rep, rows: int, dtype):
    return jax.jit(lambda x: jax.sharding.reshard(x, rep)[:rows].astype(dtype), out_shardings=rep)


def default_group_key(path: tuple) -> Hashable:
    """Group by layer: the path up to its first integer key (('blocks', 3)), else the first key
    (('embed',)). Flax NNX lists, linen `layers_3` names and plain lists all land per layer."""
    names = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        names.append(name)
        if isinstance(name, int) or (isinstance(name, str) and name.rsplit("_", 1)[-1].isdigit()):
            return tuple(names)
    return tuple(names[:1])


def _check_existing_sharding(x, path: str, mesh: Mesh, axis: str) -> None:
    """A leaf that already lives sharded must be sharded on dim 0 over `axis` of `mesh`."""
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding):
        return
    spec = tuple(sh.spec)
    used = [(d, s) for d, s in enumerate(spec) if s is not None]
    if not used:
        return
    for d, s in used:
        if d != 0:
            raise ValueError(f"shard: leaf {path} is sharded on dim {d} ({sh.spec}); TIDE shards "
                             f"dim 0 only (FSDP2's Shard(0)). Replicate it or reshard it to "
                             f"P({axis!r}) first")
    if sh.mesh.shape != mesh.shape or sh.mesh.axis_names != mesh.axis_names:
        raise ValueError(f"shard: leaf {path} lives on mesh {dict(sh.mesh.shape)} but shard() was "
                         f"given mesh {dict(mesh.shape)} (mesh mismatch)")
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    if tuple(axes) != (axis,):
        raise ValueError(f"shard: leaf {path} is sharded on dim 0 over {spec[0]!r}, not over the "
                         f"FSDP axis {axis!r} (mesh mismatch)")


def shard(params, mesh: Mesh, axis: str = "fsdp", *, shard_dtype=jnp.float32,
          ag_dtype=jnp.bfloat16, group_key: Callable[[tuple], Hashable] = default_group_key,
          max_group_params: int = MAX_GROUP_PARAMS):
    """Shards a Flax NNX state, linen variables or any pytree of arrays for TIDE.

    Returns `(sharded, layout)`: `sharded` has the tree structure of `params` with global
    (N R_p, ...) leaves in `shard_dtype` (fp32 master weights by default), sharded P(axis);
    `layout` is the static ShardLayout that `gather`, `reduce_scatter` and `unshard` take.
    `jax.ShapeDtypeStruct` leaves give ShapeDtypeStruct leaves of that shape and sharding
    (nothing is allocated): a restore target on this mesh.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"shard: axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    from tide_xla.context import check_even_processes
    check_even_processes(mesh, "tide_xla.shard")
    if (isinstance(max_group_params, bool) or not isinstance(max_group_params, int)
            or not 1 <= max_group_params <= MAX_GROUP_PARAMS):
        raise ValueError(f"shard: max_group_params must be an int in [1, {MAX_GROUP_PARAMS}], "
                         f"got {max_group_params!r}")
    sd, ad = _dtype_arg("shard_dtype", shard_dtype), _dtype_arg("ag_dtype", ag_dtype)
    if sd != ad and (sd, ad) != (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"shard: shard_dtype {sd} with ag_dtype {ad}: TIDE-AG gathers in the "
                         f"shard dtype or casts float32 shards to bfloat16")
    n = mesh.shape[axis]
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not flat:
        raise ValueError("shard: params has no array leaves")
    keys: dict[Hashable, list[int]] = {}
    leaves, arrays, dtypes, narrowed = [], [], [], []
    for i, (path, x) in enumerate(flat):
        name = jax.tree_util.keystr(path)
        shape = tuple(int(d) for d in np.shape(x))
        if not shape or shape[0] == 0:
            raise ValueError(f"shard: leaf {name} has shape {shape}; TIDE shards dim 0, which "
                             f"must exist and be non-empty (keep scalars out of the sharded tree)")
        dt = _leaf_dtype(x, name)
        if _narrowed(dt, sd):
            narrowed.append(f"{name} ({dt})")
        _check_existing_sharding(x, name, mesh, axis)
        keys.setdefault(group_key(path), []).append(i)
        leaves.append((name, shape))
        arrays.append(x)
        dtypes.append(jnp.dtype(jnp.result_type(np.zeros((), dt))))  # what JAX holds it as
    groups, leaf_group = [], {}
    for key, idx in keys.items():
        for start in range(0, len(idx), max_group_params):
            chunk = tuple(idx[start:start + max_group_params])
            gname = "/".join(str(k) for k in key) + (f"#{start // max_group_params}"
                                                      if len(idx) > max_group_params else "")
            for i in chunk:
                leaf_group[i] = len(groups)
            groups.append(ShardGroup(name=gname, leaves=chunk))
    rows = [0] * len(leaves)
    for grp in groups:  # R_p from the planner's layout of each group
        for i, pl in zip(grp.leaves, tide.layout([leaves[i][1] for i in grp.leaves], n).params):
            rows[i] = pl.R
    if narrowed:
        x64 = ("; jax_enable_x64 is off, so JAX holds float64 as float32 and unshard returns "
               "float32" if any("float64" in n for n in narrowed) and not jax.config.jax_enable_x64
               else "")
        which = (f"leaf {narrowed[0]} rounds" if len(narrowed) == 1 else
                 f"{len(narrowed)} leaves round ({', '.join(narrowed[:4])}"
                 f"{', ...' if len(narrowed) > 4 else ''})")
        warnings.warn(f"shard: {which} into shard_dtype {sd.name}{x64} "
                      f"(unshard(shard(p)) is not p bit for bit; cast them yourself to silence "
                      f"this)", UserWarning, stacklevel=2)
    layouts = tuple(LeafLayout(path=name, shape=shape, rows=rows[i], group=leaf_group[i],
                               dtype=dtypes[i])
                    for i, (name, shape) in enumerate(leaves))
    layout = ShardLayout(mesh=mesh, axis=axis, world=n, treedef=treedef, leaves=layouts,
                         groups=tuple(groups), shard_dtype=sd, ag_dtype=ad)
    target = NamedSharding(mesh, P(axis))

    def pad(x, l):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((n * l.rows, *l.shape[1:]), shard_dtype, sharding=target)
        x = jnp.asarray(x, shard_dtype)
        extra = n * l.rows - l.shape[0]
        return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1)) if extra else x

    sharded = [pad(x, l) if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(pad(x, l), target)
               for x, l in zip(arrays, layouts)]
    return jax.tree_util.tree_unflatten(treedef, sharded), layout
