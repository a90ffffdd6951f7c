"""A virtual TIDE cluster on ONE device, through tide_xla's FFI handlers (tests, one-GPU
machines): a harness above the XLA face, not part of it.

    full = virtual_all_gather(shards, dims0, topology=(2, 2))   # shards[p]: [N, R_p, ...]
    packed = virtual_reduce_scatter(grads, topology=(2, 2))      # grads[p]: [N, D_p, ...]

Every rank's buffer is stacked on a leading axis of N = M * L (rank r = n*L + l is row r); the
results are stacked the same way: TIDE-AG gives [N, D_p, ...] per parameter (every rank's copy of
the full parameter), TIDE-RS gives [N, E] (rank r's packed fp32 shard, E = sum_p R_p K_p,
parameter p at its o32_p of tide.layout). The targets "tide_all_gather_virtual" /
"tide_reduce_scatter_virtual" take the topology as attributes (nodes x gpus_per_node = the
virtual world N on this device) and run the plan, programs and executor of the mesh path with
rank r's buffers the r-th slices: on CUDA one CudaExecutor over an InProcessFabric with every
rank on this GPU, on XLA:CPU run_cpu. The device is the one the operands live on
(`jax.device_put(x, device)`); no mesh, no shard_map. Eager and under jax.jit.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import tide
from tide_xla._registration import ensure_registered
from tide_xla.context import MODES, resolve_topology


_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _attrs(topology, n: int, mode: str, timeout_s: float) -> dict[str, Any]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if topology is None:
        raise ValueError("topology: the virtual cluster needs (nodes, gpus_per_node)")
    m, l_ = resolve_topology(topology, n)
    return dict(nodes=np.int64(m), gpus_per_node=np.int64(l_), mode=np.int64(MODES[mode]),
                timeout_ms=np.int64(max(1, math.ceil(timeout_s * 1000))))


def _world(topology) -> int:
    if isinstance(topology, (tuple, list)) and len(topology) == 2:
        return int(topology[0]) * int(topology[1])
    if hasattr(topology, "nodes"):
        return int(topology.nodes) * int(topology.gpus_per_node)
    raise TypeError(f"topology: expected (nodes, gpus_per_node) or tide.Topology, got {topology!r}")


def virtual_all_gather(shards: Sequence[jax.Array], dims0: Sequence[int], topology, *,
                       ag_dtype=None, mode: str = "in_place", timeout_s: float = 60.0):
    """TIDE-AG of N virtual ranks on one device: shards[p] is [N, R_p, ...] (R_p = ceil(D_p/N),
    dim-0 padding as FSDP2 pads), returns [N, D_p, ...] per parameter in `ag_dtype` (default the
    shard dtype; float32 shards may be gathered as bfloat16)."""
    n = _world(topology)
    shards = list(shards)
    if len(shards) != len(dims0) or not shards:
        raise ValueError(f"virtual_all_gather: {len(shards)} shards for dims0 of {len(dims0)} "
                         f"parameters (one stacked shard per parameter, at least one)")
    sd = jnp.dtype(shards[0].dtype)
    ad = jnp.dtype(ag_dtype) if ag_dtype is not None else sd
    rows = [pl.R for pl in tide.layout([(int(d),) for d in dims0], n).params]
    for p, (x, d, r) in enumerate(zip(shards, dims0, rows)):
        if x.ndim < 2 or x.shape[0] != n or x.shape[1] != r:
            raise ValueError(f"virtual_all_gather: shards[{p}] has shape {tuple(x.shape)}; "
                             f"expected ({n}, {r}, ...): N = {n} ranks of R_p = ceil({d}/{n}) "
                             f"rows")
        if jnp.dtype(x.dtype) != sd or sd not in _DTYPES:
            raise ValueError(f"virtual_all_gather: shards[{p}] has dtype {x.dtype}; every shard "
                             f"must be {sd} (bfloat16, float16 or float32)")
    ensure_registered()
    out_types = [jax.ShapeDtypeStruct((n, int(d), *x.shape[2:]), ad)
                 for x, d in zip(shards, dims0)]
    call = jax.ffi.ffi_call("tide_all_gather_virtual", out_types, vmap_method="sequential")
    return list(call(*shards, dims0=np.asarray(dims0, np.int64),
                     **_attrs(topology, n, mode, timeout_s)))


def virtual_reduce_scatter(grads: Sequence[jax.Array], topology, *, scale: float = 1.0,
                           accumulate: jax.Array | None = None, mode: str = "in_place",
                           timeout_s: float = 60.0):
    """TIDE-RS of N virtual ranks on one device: grads[p] is [N, D_p, ...] (rank r's full
    gradient of parameter p), returns [N, E] float32: rank r's packed shard of
    scale * sum_r' grads[p][r'] (plus `accumulate`, an [N, E] float32 array aliased to the
    result, when given)."""
    n = _world(topology)
    grads = list(grads)
    if not grads:
        raise ValueError("virtual_reduce_scatter: no gradients")
    gd = jnp.dtype(grads[0].dtype)
    for p, g in enumerate(grads):
        if g.ndim < 2 or g.shape[0] != n:
            raise ValueError(f"virtual_reduce_scatter: grads[{p}] has shape {tuple(g.shape)}; "
                             f"expected ({n}, D_p, ...): one full gradient per rank")
        if jnp.dtype(g.dtype) != gd or gd not in _DTYPES:
            raise ValueError(f"virtual_reduce_scatter: grads[{p}] has dtype {g.dtype}; every "
                             f"gradient must be {gd} (bfloat16, float16 or float32)")
    dims0 = [int(g.shape[1]) for g in grads]
    e = tide.layout([g.shape[1:] for g in grads], n).E
    out_type = jax.ShapeDtypeStruct((n, e), jnp.float32)
    operands, aliases = list(grads), {}
    if accumulate is not None:
        if tuple(accumulate.shape) != (n, e) or jnp.dtype(accumulate.dtype) != jnp.float32:
            raise ValueError(f"virtual_reduce_scatter: accumulate has shape "
                             f"{tuple(accumulate.shape)} {accumulate.dtype}; expected ({n}, {e}) "
                             f"float32")
        operands.append(accumulate)
        aliases = {len(grads): 0}
    ensure_registered()
    call = jax.ffi.ffi_call("tide_reduce_scatter_virtual", out_type, vmap_method="sequential",
                            input_output_aliases=aliases)
    return call(*operands, dims0=np.asarray(dims0, np.int64), scale=np.float32(scale),
                accumulate=np.int64(accumulate is not None),
                **_attrs(topology, n, mode, timeout_s))


def stack_shards(full: jax.Array, n: int) -> jax.Array:
    """A full parameter (D, ...) as the virtual cluster's stacked shards [N, R, ...] (zero
    padded rows, FSDP2's dim-0 padding)."""
    r = tide.layout([full.shape], n).params[0].R
    pad = [(0, n * r - full.shape[0])] + [(0, 0)] * (full.ndim - 1)
    return jnp.pad(full, pad).reshape((n, r, *full.shape[1:]))
