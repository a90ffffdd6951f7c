"""TIDE groups whose ranks live in several processes (jax.distributed), on XLA:CPU and CUDA.

Contract
  - Processes are started with `jax.distributed.initialize(...)`; each holds its own host
    devices, and the mesh holds devices of several of them. Every process traces the same program,
    so the cross-process calls of one process come in the same order as on every other process:
    the n-th one of each process is the same call.
  - At trace time, before the FFI call is emitted, `prepare()` (1) agrees the call across the
    mesh's processes: each publishes (plan hash, device-table fingerprint, a description) under
    the call's number in jax.distributed's key-value store and reads every other's; a difference
    is a ValueError on every process naming the processes and what each has, a process that does
    not arrive within the context's timeout a TimeoutError naming it; (2) the first time a
    (collective, plan, mesh) is seen, creates one POSIX shared-memory segment per local rank
    (mode 0600), exchanges the names through the store, has the C++ core map every rank's segment
    (one CPU RankExecutor per local rank, tide_xla._ffi.open_rank) and, once every process has
    mapped them, unlinks its own names (nothing outlives the processes; atexit unlinks what is
    left after a failure).
  - On CUDA (one process per GPU, several processes sharing one GPU, or one process holding
    several ranks of its node, e.g. one per host) step (2) is instead: each local rank allocates
    a CUDA-IPC arena and publishes its handle, node 0's rank of each local index publishes its
    rail's NCCL unique id (several nodes), every rank opens its node's arenas (this process's by
    pointer) and joins its rail, and a barrier follows ([Note: CUDA rank states] below). A
    process holding ranks of two nodes of one group is refused at trace time, naming them.
  - At run time each device's call runs only its rank's program over those segments
    ([Note: cross-process ranks] in ffi/executor.cc): same programs, same op interpreter, so the
    bytes equal one process holding every device.
  - A rank's TimeoutError inside a call gets the survivors' diagnosis (tide/diagnosis.py) over
    jax.distributed's key-value store appended by the handler that timed out: the chain of posted
    roots down to the rank (and process) that stopped.
  - Never imports torch. The store is jax's coordination-service client
    (jax._src.distributed.global_state.client: key_value_set, key_value_dir_get); jax has no
    public key-value API in the releases tide_xla supports.
"""
from __future__ import annotations

import atexit
import itertools
from typing import Sequence

import numpy as np

import tide
from tide import diagnosis, shm
from tide.ranks import await_keys
from tide_xla._registration import ffi_module

_PREFIX = "tide_xla"
_calls = itertools.count()          # this process's cross-process calls, in trace order
_segments: set[str] = set()         # names this process created and has not unlinked yet
_diagnosing = False                 # the survivors' diagnosis is set in tide_xla._ffi


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "tide_xla: the mesh holds devices of several processes but jax.distributed is not "
            "initialised in this process; call jax.distributed.initialize(...) first")
    return client


def _survivors(message: str, group: int, rank: int, owners: list[int], timeout_ms: int) -> str:
    """The survivors' diagnosis of a rank's timeout (the handler calls it; see the contract)."""
    from jax._src import distributed
    client = distributed.global_state.client
    return diagnosis.appended(message, rank, timeout_ms / 1000, client and diagnosis.DirStore(client),
                              prefix=f"{_PREFIX}/timeout/{group}/", name=lambda r: f"rank {r} (process {owners[r]})")


def _exchange(key: str, value: str, processes: Sequence[int], timeout_ms: int,
              what: str) -> dict[int, str]:
    """Publishes `value` as this process's under `key` and returns every process's value; a
    TimeoutError names the processes that did not publish within `timeout_ms`."""
    import jax
    client = _client()
    me = jax.process_index()
    client.key_value_set(f"{key}/{me}", value)

    def late(missing):
        return TimeoutError(
            f"tide_xla: {what}: process {me} waited {timeout_ms / 1000:g} s for processes "
            f"{missing} of the mesh's processes {list(processes)} to reach it (a process that "
            f"died, does not run this call, runs another program, or hangs)")

    got = await_keys(client.key_value_dir_get, key, processes, timeout_ms, late)
    return {p: got[p] for p in processes}


_barriers = itertools.count()       # this process's barriers (tide_xla.release), in call order
_generation: dict[int, int] = {}    # device-table fingerprint -> its releases so far


def released(table: int) -> None:
    """The states of `table` were released (tide_xla.release, on every process): the next ones
    exchange their segment names / handles under fresh store keys (the old keys stay set)."""
    _generation[table] = _generation.get(table, 0) + 1


def barrier(ctx, what: str) -> None:
    """Waits until every process of the context's mesh has reached this barrier (the n-th of each
    process is the same one); a TimeoutError names the processes missing."""
    _exchange(f"{_PREFIX}/barrier/{next(_barriers)}", "1", ctx.processes, ctx.timeout_ms, what)


def _disagreement(values: dict[int, str]) -> str:
    by_value: dict[str, list[int]] = {}
    for p, v in values.items():
        by_value.setdefault(v, []).append(p)
    parts = []
    for v, ps in sorted(by_value.items(), key=lambda kv: kv[1]):
        plan, table, desc = v.split("|", 2)
        who = "process" if len(ps) == 1 else "processes"
        parts.append(f"{who} {', '.join(map(str, ps))}: {desc} (plan hash {plan}, mesh {table})")
    return "; ".join(parts)


def _create_segment(nbytes: int) -> str:
    name, _ = shm.create("tide_xla", nbytes)  # zero-filled: the counters start at 0
    _segments.add(name)
    return name


def _unlink(name: str) -> None:
    shm.unlink(name)
    _segments.discard(name)


@atexit.register
def _unlink_all() -> None:
    for name in list(_segments):
        _unlink(name)


def _local_slots(ctx) -> list[tuple[int, int]]:
    """(group, rank) of this process's devices in the context's device table."""
    import jax
    me = jax.process_index()
    t = np.asarray(ctx.device_table, np.int64).reshape(-1, 5)
    return [(int(g), int(r)) for p, _, _, g, r in t if p == me]


def prepare(ctx, op: str, shapes: Sequence[Sequence[int]], in_dtype, out_dtype) -> None:
    """Agrees call `op` over parameters `shapes` with every process of the mesh and opens this
    process's rank states for it (see the contract)."""
    import jax
    platform = ctx.mesh.devices.flat[0].platform
    cuda = platform in ("gpu", "cuda")
    if not cuda and platform != "cpu":
        raise NotImplementedError(
            f"tide_xla: {op}: the mesh spans processes {list(ctx.processes)} on {platform}; "
            f"tide_xla runs a mesh across processes on XLA:CPU and CUDA")
    ffi = ffi_module()
    global _diagnosing
    if not _diagnosing:
        ffi.set_timeout_diagnosis(_survivors)
        _diagnosing = True
    if cuda:
        _check_cuda_slots(ctx, op)
    shapes = [[int(d) for d in s] for s in shapes]
    in_name, out_name = np.dtype(in_dtype).name, np.dtype(out_dtype).name
    plan_args = (op, shapes, in_name, out_name, ctx.nodes, ctx.gpus_per_node, ctx.mode_id)
    info = ffi.group_plan(*plan_args)
    table = ffi.table_fingerprint(list(ctx.device_table))
    n = next(_calls)
    desc = (f"{op} of {len(shapes)} parameter(s) {[tuple(s) for s in shapes]} {in_name} -> "
            f"{out_name} on {ctx.nodes}x{ctx.gpus_per_node} ranks ({ctx.mode})")
    slots = [s for s in _local_slots(ctx)
             if not ffi.has_rank(op, info["hash"], table, *s)]
    short_of = "" if cuda else shm.shortfall(len(slots) * int(info["segment_bytes"]))
    room = f"its {len(slots)} segment(s) {short_of}" if short_of else ""
    values = _exchange(f"{_PREFIX}/call/{n}", f"{info['hash']:016x}|{table:016x}|{room}|{desc}",
                       ctx.processes, ctx.timeout_ms, f"cross-process call #{n} ({desc})")
    short = {p: v.split("|", 3)[2] for p, v in values.items() if v.split("|", 3)[2]}
    if short:  # every process learns it in the same exchange: all raise, nobody waits
        raise tide.PlanError(
            f"tide_xla: cross-process call #{n} ({desc}): not enough shared memory for the arena "
            f"segments: " + "; ".join(f"process {p}: {why}" for p, why in sorted(short.items())))
    values = {p: "|".join(v.split("|", 3)[:2] + v.split("|", 3)[3:]) for p, v in values.items()}
    if len(set(values.values())) > 1:
        raise ValueError(
            f"tide_xla: cross-process call #{n}: the processes of the mesh disagree on the call "
            f"(every process must trace the same model, parameters and mesh): "
            f"{_disagreement(values)}")
    if not slots:
        return
    if cuda:
        _open_cuda_ranks(ctx, ffi, plan_args, info["hash"], table, slots, desc)
        return
    # Every process reaches this point for the same (collective, plan, mesh): one segment per rank.
    key = f"{_PREFIX}/seg/{op}/{info['hash']:016x}/{table:016x}.{_generation.get(table, 0)}"
    client = _client()
    mine, learned = {}, set()
    for group, rank in slots:
        mine[(group, rank)] = name = _create_segment(int(info["segment_bytes"]))
        client.key_value_set(f"{key}/{group}/{rank}", name)
    try:
        for group in sorted({g for g, _ in slots}):
            names = _exchange_ranks(client, f"{key}/{group}", ctx, group)
            learned.update(names)
            for g, rank in slots:
                if g == group:
                    ffi.open_rank(*plan_args, table, group, rank, names, ctx.timeout_ms)
        # Unlink only once every process has mapped every segment.
        _exchange(f"{key}/mapped", "1", ctx.processes, ctx.timeout_ms,
                  f"mapping the arena segments of {desc}")
    finally:
        # The peers' names too (after the barrier every process has mapped them; on a failure
        # nobody will): a process killed after publishing its names leaves no segment behind
        # (docs/architecture.md, "Shared-memory segments"). A name unlinked twice is harmless.
        for name in mine.values():
            _unlink(name)
        for name in learned - set(mine.values()):
            shm.unlink(name)


def _exchange_ranks(client, key: str, ctx, group: int, ranks=None, what: str = "arena segments") -> list[str]:
    """Every rank's value under `key` for `group` (published by its owning process): the arena
    segment names (CPU), IPC handles or rail ids (CUDA: ranks 0..L-1, node 0's); `what` names
    them in the timeout."""
    import jax
    ranks = range(ctx.world) if ranks is None else ranks
    owner = {int(r): int(p) for p, _, _, g, r in _rows(ctx) if g == group}

    def late(missing):
        procs = sorted({owner[r] for r in missing})
        return TimeoutError(
            f"tide_xla: process {jax.process_index()} waited {ctx.timeout_ms / 1000:g} s for "
            f"the {what} of ranks {missing} of group {group} from processes {procs}")
    got = await_keys(client.key_value_dir_get, key, ranks, ctx.timeout_ms, late)
    return [got[r] for r in ranks]


# ---- CUDA ------------------------------------------------------------------------------------
# [Note: CUDA rank states] in ffi/executor_cuda.cc: each local rank gets its own CUDA-IPC arena
# and, with several nodes, its own NCCL rail; the handles and the rails' unique ids travel through
# the key-value store. Peers of one node open each other's arenas by IPC (other GPUs of the host,
# or other processes on the same GPU); other nodes are reached only through the rail.

def _rows(ctx):
    return np.asarray(ctx.device_table, np.int64).reshape(-1, 5)


def _check_cuda_slots(ctx, op: str) -> None:
    """On CUDA a process may hold several ranks of one topology node per group (their arenas by
    pointer: [Note: same-process peers] in csrc/fabric/ipc.h), not ranks of two nodes: a node is
    a host, and the two would meet on an NCCL rail with both ends in this process."""
    import jax
    me, L = jax.process_index(), ctx.gpus_per_node
    seen: dict[int, int] = {}
    for p, _, _, g, r in _rows(ctx):
        if int(p) == me and seen.setdefault(int(g), int(r)) // L != int(r) // L:
            raise NotImplementedError(
                f"tide_xla: {op}: process {me} holds rank {seen[int(g)]} of node {seen[int(g)] // L} and rank "
                f"{int(r)} of node {int(r) // L} (group {int(g)}, topology {ctx.nodes}x{L}); on CUDA a process "
                f"holds ranks of its own node only (a node is a host): pass a topology whose nodes are the "
                f"processes' hosts")


_nccl_paths_added = False


def _add_nccl_candidates(ffi) -> None:
    """The nvidia.nccl wheel's libnccl.so.2 for the rails (after the copy JAX has loaded)."""
    global _nccl_paths_added
    if _nccl_paths_added:
        return
    _nccl_paths_added = True
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        spec = None
    paths = [f"{loc}/lib/libnccl.so.2" for loc in (spec.submodule_search_locations or [])] if spec else []
    ffi.nccl_library_candidates(paths)


def _rail_late(ctx, client, key: str, group: int, rank: int, err: Exception) -> TimeoutError:
    """The TimeoutError of rank `rank`'s rail construction: the processes of its rail peers that
    never reached it (no "joining" key), else every rail peer's process."""
    import jax
    L = ctx.gpus_per_node
    owner = {int(r): int(p) for p, _, _, g, r in _rows(ctx) if g == group}
    peers = [r for r in range(rank % L, ctx.world, L) if r != rank]
    joined = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(f"{key}/")}
    absent = [r for r in peers if r not in joined] or peers
    return TimeoutError(
        f"tide_xla: process {jax.process_index()}: rank {rank}'s NCCL rail (group {group}) waited "
        f"{ctx.timeout_ms / 1000:g} s for ranks {absent} of processes {sorted({owner[r] for r in absent})}"
        f"{' (they never reached it: dead or hung)' if absent != peers else ''}; the rail was aborted ({err})")


def _open_cuda_ranks(ctx, ffi, plan_args, plan_hash: int, table: int, slots, desc: str) -> None:
    """Creates this process's rank states for one (collective, plan, mesh) on CUDA: arenas, handle
    exchange, rails (see the note above), then a barrier once every process is connected."""
    import jax
    op = plan_args[0]
    client = _client()
    key = f"{_PREFIX}/cuda/{op}/{plan_hash:016x}/{table:016x}.{_generation.get(table, 0)}"
    me, L = jax.process_index(), ctx.gpus_per_node
    local = {(int(g), int(r)): int(dev) for p, _, dev, g, r in _rows(ctx) if int(p) == me}
    if ctx.nodes > 1:
        _add_nccl_candidates(ffi)
    for group, rank in slots:
        handle = ffi.create_cuda_rank(*plan_args, table, group, rank, local[(group, rank)], ctx.timeout_ms)
        client.key_value_set(f"{key}/{group}/ipc/{rank}", bytes(handle).hex())
        if ctx.nodes > 1 and rank < L:  # node 0's rank of local index `rank` names its rail
            client.key_value_set(f"{key}/{group}/rail/{rank}", bytes(ffi.nccl_unique_id()).hex())
    for group in sorted({g for g, _ in slots}):
        handles = _exchange_ranks(client, f"{key}/{group}/ipc", ctx, group, what="CUDA IPC handles")
        rails = (_exchange_ranks(client, f"{key}/{group}/rail", ctx, group, range(L), what="NCCL rail ids")
                 if ctx.nodes > 1 else None)
        for g, rank in slots:
            if g == group:
                # Collective over the rail's ranks (one per node, each in its own process): every
                # process connects its ranks in the same (group, rank) order. The rail's
                # construction has the context's deadline ([Note: rail deadline] in
                # csrc/fabric/nccl.cc); who never reached it is read from the "joining" keys.
                client.key_value_set(f"{key}/{group}/joining/{rank}", "1")
                try:
                    ffi.connect_cuda_rank(op, plan_hash, table, group, rank, [bytes.fromhex(h) for h in handles],
                                          bytes.fromhex(rails[rank % L]) if rails else b"")
                except Exception as e:  # noqa: BLE001 - a rail deadline is named, anything else re-raised
                    if "did not join within" not in str(e) and "did not answer within" not in str(e):
                        raise
                    raise _rail_late(ctx, client, f"{key}/{group}/joining", group, rank, e) from e
    _exchange(f"{key}/connected", "1", ctx.processes, ctx.timeout_ms, f"connecting the CUDA ranks of {desc}")
