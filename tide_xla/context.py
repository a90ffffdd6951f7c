"""`tide_xla.init`: the TIDE context of one mesh axis (topology, mode, device table), and
`tide_xla.release`: the end of its states' lifetime.

[Note: context lifetime]
The first TIDE call of a (collective, plan, mesh group) builds a state in tide_xla._ffi: its
session, its executor and its arenas (host memory on XLA:CPU, cudaMalloc on CUDA; a mesh spanning
processes: one rank state per local rank, with its shared-memory segment or CUDA-IPC arena). The
states belong to the mesh's device table (its fingerprint; ffi/tide_ffi.h [Note: state lifetime])
and live until `release(mesh, axis)` (or `ctx.release()`, or leaving `with tide_xla.init(...)`)
frees them; `init` of a (mesh, axis) that already has a context releases the old one's states
first. Contract: release after the last call that uses them has finished (its results are ready,
e.g. `jax.block_until_ready`), on every process of a mesh that spans processes (release waits
for every process there: peers push into this process's arenas until their last call). A
function traced before the release and run afterwards raises (INVALID_ARGUMENT naming
tide_xla.release) until the mesh is initialised again; then it runs on fresh states (in one
process) or must be traced again (a mesh spanning processes prepares its states at trace time).
`live_states()` counts the states and their arena bytes. The virtual cluster's states
(tide_xla.virtual) are not tied to a mesh and live as long as the process.

[Note: world 1]
The policy of both faces (tide_torch/groups.py, [Note: world 1] there): an FSDP axis of one
device keeps stock by default, with one log line: there is nothing to gather or reduce, so TIDE
saves no bytes, and its arena would only add memory. `gather` is then the cast JAX would do
(shard -> ag_dtype; at N = 1 R_p = D_p, no padding) and `reduce_scatter` the cast back, times the
scale, into the packed layout (the same bits as TIDE-RS at N = 1); nothing reaches the FFI.
`init(..., serve_single_rank=True)` serves it anyway (tests on one GPU).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np
from jax.sharding import Mesh

from tide_xla._registration import ensure_registered, ffi_module

MODES = {"in_place": 0, "slot_reuse": 1}
logger = logging.getLogger("tide_xla")


@dataclasses.dataclass(frozen=True)
class TideContext:
    """Everything static a TIDE call needs about the mesh axis it runs over.

    Ranks of one FSDP group are the devices along `axis`; rank r = n*L + l (node-major), which is
    the device's index along `axis`. Devices that differ in the other mesh axes (e.g. `data` in an
    fsdp x data mesh) form separate groups, named by `group` in the device table.
    """

    mesh: Mesh
    axis: str
    nodes: int           # M
    gpus_per_node: int   # L
    mode: str            # "in_place" | "slot_reuse"
    timeout_ms: int      # rendezvous/executor wait budget of one call
    device_table: tuple[int, ...]  # flat (process, device id, local device, group, rank)
    processes: tuple[int, ...] = (0,)  # jax process indices holding devices of the mesh
    served: bool = True  # False: N = 1 kept stock ([Note: world 1]): calls are plain JAX casts

    @property
    def spans_processes(self) -> bool:
        """True when some device of the mesh belongs to another process: the calls then run
        through the cross-process rank executors (tide_xla/processes.py)."""
        import jax
        return self.processes != (jax.process_index(),)

    @property
    def world(self) -> int:
        """N = M * L, the size of `axis`."""
        return self.nodes * self.gpus_per_node

    @property
    def mode_id(self) -> int:
        """The core's number for `mode`."""
        return MODES[self.mode]

    def where(self):
        """This device's (index along `axis`, group index) inside the running shard_map, as the
        handler's first operand: it checks them against the device table (mesh mismatch).
        The group is the flat index over the other axes, or -1 when one of them is not manual."""
        import jax
        import jax.numpy as jnp
        manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
        rank = jax.lax.axis_index(self.axis)
        group = jnp.int32(0)
        for name in self.mesh.axis_names:
            if name == self.axis:
                continue
            if name not in manual:
                group = jnp.int32(-1)
                break
            group = group * self.mesh.shape[name] + jax.lax.axis_index(name)
        return jnp.stack([rank, group]).astype(jnp.int32)

    def attrs(self, op_id: int) -> dict[str, Any]:
        """FFI attributes shared by both ops (types as XLA checks them at run time)."""
        return dict(
            device_table=np.asarray(self.device_table, np.int64),
            nodes=np.int64(self.nodes),
            gpus_per_node=np.int64(self.gpus_per_node),
            mode=np.int64(MODES[self.mode]),
            op_id=np.int64(op_id),
            timeout_ms=np.int64(self.timeout_ms),
        )

    def release(self) -> int:
        """``tide_xla.release(self.mesh, self.axis)`` (see [Note: context lifetime])."""
        return release(self.mesh, self.axis)

    def __enter__(self) -> "TideContext":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


_CONTEXTS: dict[tuple[Mesh, str], TideContext] = {}


def check_even_processes(mesh: Mesh, where: str) -> None:
    """A mesh spanning processes needs every process of the job to hold the same number of
    devices: jax's own multi-process placement (device_put's cross-process check,
    process_allgather) reshapes the job's devices as (processes, devices per process). Refused
    naming each process's count (else JAX's "cannot reshape array of size 5 into shape (2,2)" at
    the first placement of a shard)."""
    import jax
    if len({int(d.process_index) for d in mesh.devices.flat}) < 2:
        return
    counts: dict[int, int] = {}
    for d in jax.devices(mesh.devices.flat[0].platform):
        counts[int(d.process_index)] = counts.get(int(d.process_index), 0) + 1
    if len(set(counts.values())) > 1:
        each = ", ".join(f"process {p}: {c} device{'s' if c != 1 else ''}"
                         for p, c in sorted(counts.items()))
        raise ValueError(f"{where}: the job's {sum(counts.values())} devices are split unevenly "
                         f"over its {len(counts)} processes ({each}); a mesh across processes "
                         f"needs every process to hold the same number (jax's multi-process "
                         f"placement of the shards does): give each process the same device "
                         f"count (XLA_FLAGS --xla_force_host_platform_device_count, "
                         f"local_device_ids)")


def resolve_topology(topology: Any, n: int) -> tuple[int, int]:
    if topology is None:
        if n <= 8:
            return 1, n
        if n % 8:
            raise ValueError(f"topology=None: cannot split {n} ranks into nodes of 8; pass "
                             f"topology=(nodes, gpus_per_node)")
        return n // 8, 8
    if isinstance(topology, (tuple, list)) and len(topology) == 2:
        m, l_ = topology
    elif hasattr(topology, "nodes") and hasattr(topology, "gpus_per_node"):
        m, l_ = topology.nodes, topology.gpus_per_node
    else:
        raise TypeError(f"topology: expected None, (nodes, gpus_per_node) or tide.Topology, "
                        f"got {topology!r}")
    for name, v in (("nodes", m), ("gpus_per_node", l_)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"topology: {name} must be an int, got {v!r} in {topology!r}")
    m, l_ = int(m), int(l_)
    if m < 1:
        raise ValueError(f"topology: nodes must be >= 1, got {m}")
    if m * l_ != n:
        raise ValueError(f"topology {m}x{l_} has {m * l_} ranks but mesh axis has {n} devices")
    if not 1 <= l_ <= 8:
        raise ValueError(f"topology: gpus_per_node must be in [1, 8], got {l_}")
    return m, l_


def local_device_index(mesh: Mesh) -> dict[Any, tuple[int, int, int]]:
    """(process index, device id, local device) of every device of `mesh`, the same on every
    process. The local device is the owner's local_hardware_id, taken for another process's device
    as its position among that process's devices in id order. A handler matches its ordinal (the
    device id on XLA:CPU, the local device on XLA:GPU) against the rows of its own process."""
    import jax
    me = jax.process_index()
    by_process: dict[int, list[Any]] = {}
    for d in sorted(jax.devices(mesh.devices.flat[0].platform), key=lambda d: d.id):
        by_process.setdefault(d.process_index, []).append(d)
    out = {}
    for d in mesh.devices.flat:
        if d.process_index == me and d.local_hardware_id is not None:
            local = int(d.local_hardware_id)
        else:
            local = by_process[d.process_index].index(d)
        out[d] = (int(d.process_index), int(d.id), local)
    return out


def device_table(mesh: Mesh, axis: str) -> tuple[int, ...]:
    """(process, device id, local device, group, rank) for every device of `mesh`: rank = index
    along `axis`, group = flat index over the other axes. Built from the concrete Mesh, never from
    device ordinals; a handler finds its row by (this process, its ordinal), so with one process
    per device every device still gets its own rank."""
    ax = mesh.axis_names.index(axis)
    devs = np.moveaxis(np.asarray(mesh.devices), ax, -1)
    devs = devs.reshape(-1, devs.shape[-1])
    where = local_device_index(mesh)
    table = []
    for group, row in enumerate(devs):
        for rank, d in enumerate(row):
            table += [*where[d], group, rank]
    return tuple(table)


def init(mesh: Mesh, axis: str = "fsdp", topology: Any = None, mode: str = "in_place", *,
         timeout_s: float = 60.0, serve_single_rank: bool = False) -> TideContext:
    """Sets up TIDE for the FSDP axis `axis` of `mesh` and registers the FFI handlers.

    topology: None (one node of up to 8 ranks, or nodes of 8), `(nodes, gpus_per_node)` or a
      `tide.Topology`; the virtual cluster on XLA:CPU emulates M nodes of L ranks.
    mode: "in_place" or "slot_reuse" (same bytes out; Section 5 of the paper).
    timeout_s: how long a rank waits for the others before the call fails with
      DEADLINE_EXCEEDED naming the missing ranks.
    serve_single_rank: an axis of one device keeps stock JAX (one log line) unless this is True
      ([Note: world 1]; the same option and policy as tide_torch.enable).

    A mesh whose devices belong to several processes (jax.distributed) runs on XLA:CPU through
    one rank executor per device over shared memory; see tide_xla/processes.py.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"init: mesh must be a concrete jax.sharding.Mesh, "
                        f"got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"init: axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"init: mode must be one of {sorted(MODES)}, got {mode!r}")
    if not isinstance(serve_single_rank, bool):
        raise TypeError(f"init: serve_single_rank must be a bool, got {serve_single_rank!r}")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.integer,
                                                                   np.floating))
            or not 0 < timeout_s <= 1e6):  # nan fails the range too
        raise ValueError(f"init: timeout_s must be a number of seconds in (0, 1e6], got "
                         f"{timeout_s!r}")
    check_even_processes(mesh, "tide_xla.init")
    n = mesh.shape[axis]
    nodes, gpus = resolve_topology(topology, n)
    import jax
    ctx = TideContext(mesh=mesh, axis=axis, nodes=nodes, gpus_per_node=gpus, mode=mode,
                      timeout_ms=max(1, math.ceil(timeout_s * 1000)),
                      device_table=device_table(mesh, axis),
                      processes=tuple(sorted({int(d.process_index) for d in mesh.devices.flat})),
                      served=n > 1 or serve_single_rank)
    if not ctx.served:
        logger.warning("tide_xla: axis %r of the mesh has one device: gather and reduce_scatter stay "
                       "stock JAX casts (nothing to gather or reduce, no bytes to save; "
                       "tide_xla.init(serve_single_rank=True) serves it anyway)", axis)
    ensure_registered()
    ffi = ffi_module()
    ffi.set_process_index(jax.process_index())
    if (mesh, axis) in _CONTEXTS:  # a re-init: the old context's states go first
        release(mesh, axis)
    ffi.open_table(_fingerprint(ctx))
    _CONTEXTS[(mesh, axis)] = ctx
    return ctx


def _fingerprint(ctx: TideContext) -> int:
    return int(ffi_module().table_fingerprint(list(ctx.device_table)))


def release(mesh: Mesh, axis: str = "fsdp") -> int:
    """Frees the TIDE states (sessions, executors, arenas) made for `axis` of `mesh` after their
    enqueued work, and forgets its context: TIDE calls on it raise until `init` again. Call it
    after the last call that uses them has finished; on a mesh spanning processes, on every
    process (it waits for all of them). No-op without a context. Returns how many states were
    freed (0 while another context has the same device table: they share the states).
    See [Note: context lifetime]."""
    ctx = _CONTEXTS.pop((mesh, axis), None)
    if ctx is None:
        return 0
    table = _fingerprint(ctx)
    if any(_fingerprint(c) == table for c in _CONTEXTS.values()):
        return 0
    if not ctx.spans_processes:
        return int(ffi_module().release_table(table))
    from tide_xla import processes
    processes.barrier(ctx, "tide_xla.release")
    try:
        return int(ffi_module().release_table(table))
    finally:
        processes.released(table)


def live_states() -> dict[str, int]:
    """{'group_states', 'rank_states', 'arena_bytes'}: the TIDE states this process holds (every
    context's and the virtual cluster's) and their arenas' bytes, host and devices together."""
    ensure_registered()
    return {k: int(v) for k, v in ffi_module().live_states().items()}


def context_for(mesh: Mesh, axis: str) -> TideContext:
    """The context init() made for (mesh, axis); a clear error when there is none."""
    try:
        return _CONTEXTS[(mesh, axis)]
    except KeyError:
        known = [f"{tuple(m.shape.items())}/{a}" for m, a in _CONTEXTS]
        raise ValueError(
            f"no TIDE context for axis {axis!r} of mesh {tuple(mesh.shape.items())}: call "
            f"tide_xla.init(mesh, axis={axis!r}) first (initialised: {known or 'none'})") from None


def arena_bytes(device) -> int:
    """Bytes of the TIDE arenas this process holds on `device` (a jax GPU device of this process):
    plain cudaMalloc outside XLA's allocator, so `device.memory_stats()` does not count them.
    0 on XLA:CPU (the arenas are host memory), before the first TIDE call on `device` and once
    every state on it is released (`release`; `live_states()` counts the host's too)."""
    if device.platform == "cpu":
        return 0
    ffi = ffi_module()
    return int(ffi.device_arena_bytes(int(device.local_hardware_id))) if ffi.built_with_cuda else 0
