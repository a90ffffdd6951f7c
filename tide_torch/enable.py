"""``tide_torch.enable(model)``: plan, agree, place, patch — and ``TideHandle.disable()``."""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import tide
from tide import env, shm
from tide_torch import _patches, agreement, all_gather, comm, placement, reduce_scatter
from tide.plan import check_options
from tide.regions import arena_nbytes
from tide_torch.arena import Arena, make_nccl_fabric, nccl_fabric_api_error
from tide.ranks import host_identity, node_host_problem
from tide_torch.groups import (PLAN_OPTIONS, TideEnableError, TideGroup, find_groups, log_fallback,
                               plan_group, resolve_topology)
from tide_torch.rails import GlooRail
from tide_torch.runtime import Runtime, free_in_arena

logger = logging.getLogger("tide_torch")

MODES = ("in_place", "slot_reuse")
RAILS = ("auto", "one_sided", "two_sided")
FABRICS = ("auto", "ipc", "nccl")
FABRIC_ENV = env.TORCH_FABRIC


class TideHandle:
    """What ``enable()`` returns: the plans, the arena's memory, and ``disable()``."""

    def __init__(self, runtime: Runtime, groups: list[TideGroup], topology: tide.Topology):
        self._rt = runtime
        self._groups = groups
        self.topology = topology
        self.enabled = True

    @property
    def plans(self) -> dict[str, Any]:
        """Group FQN -> tide Plan, for the groups TIDE serves (a group of several chunks:
        ``FQN[label]`` -> each chunk's plan, its parameters' group indices as runs, "0:256" or
        "0,2:5", groups.py [Note: chunks])."""
        out = {}
        for g in self._groups:
            for c in g.chunks:
                out[g.fqn if len(g.chunks) == 1 else f"{g.fqn}[{c.label}]"] = c.plan
        return out

    @property
    def fallbacks(self) -> dict[str, str]:
        """Group FQN -> why it uses stock FSDP2 collectives."""
        return {g.fqn: g.fallback for g in self._groups if not g.eligible}

    @property
    def groups(self) -> list[TideGroup]:
        return list(self._groups)

    @property
    def mode(self) -> str:
        return self._rt.mode

    @property
    def transport(self) -> str:
        return self._rt.transport.name if self._rt.transport is not None else "stock"

    @property
    def rails(self) -> str:
        """How this rank reaches other nodes: ``"two_sided"`` (only its own node's arenas are
        mapped; the rail carries the rest) or ``"one_sided"``."""
        return self._rt.rails

    @property
    def fabric(self) -> str | None:
        """The CUDA executor's fabric: ``"ipc"`` or ``"nccl"`` (None without one)."""
        return self._rt.arena.fabric_kind if self._rt.arena is not None else None

    @property
    def stats(self) -> dict[str, int]:
        """Calls served by TIDE vs. handed to stock FSDP2, per collective (``ag_own_storage``:
        TIDE all-gathers of groups that moved to their own storage); the executor's runs
        whose entry fence waited for the peers' arrival (``arrival_fences``: none on one node,
        where TIDE-AG pulls); on CUDA with ``ExecutorOptions(graphs=True)`` also the calls
        captured and launched as CUDA graphs; with an NCCL rail (two-sided rails on CUDA) its
        groups and the host's polls of their enqueue (``comm.rail_counts``)."""
        out = dict(self._rt.stats)
        out.update(comm.executor_counts(self._rt.transport))
        out.update(comm.rail_counts(self._rt.rail))
        return out

    @property
    def hand_backs(self) -> dict[tuple[str, str, str], int]:
        """(group FQN, "ag" | "rs", reason) -> calls of a served group handed to stock FSDP2
        (each reason is logged once per group)."""
        return dict(self._rt.hand_backs)

    def memory(self) -> dict[str, Any]:
        """Arena regions (bytes) and, per served group, its slot and sizes."""
        if self._rt.arena is None:
            return {"arena_bytes": 0, "regions": {}, "groups": {}, "stock_unsharded_bytes": 0}
        return placement.region_summary(self._groups, self._rt.arena)

    def landings(self) -> dict[str, tuple[int, int | None]]:
        """Parameter FQN -> (planned landing address, unsharded parameter's data_ptr or None
        before its first all-gather). An extension parameter's pre-all-gather output j is
        ``FQN#j`` -> (its planned landing, its all-gather output's data_ptr): its unsharded
        parameter is what ``fsdp_post_all_gather`` built over them (tide_torch/extensions.py).
        A group that moved to its own storage lands in FSDP2's ``all_gather_outputs[0]``: that is
        its planned address ([Note: own-storage landing], all_gather.py)."""
        out = {}
        for g in self._groups:
            if not g.eligible:
                continue
            for p, fp in enumerate(g.pg.fsdp_params):
                name = fp._param_fqn or f"{g.fqn}[{p}]"
                if g.extension[p]:
                    for j, i in enumerate(g.param_items[p]):
                        outs = fp.all_gather_outputs
                        out[f"{name}#{j}"] = (g.landing_address(i),
                                              outs[j].data_ptr() if j < len(outs) else None)
                    continue
                got = fp._unsharded_param.data_ptr() if hasattr(fp, "_unsharded_param") else None
                if g.moved is not None:  # lands in FSDP2's own all_gather_outputs (all_gather.py)
                    outs = fp.all_gather_outputs
                    out[name] = (outs[0].data_ptr() if outs else None, got)
                    continue
                out[name] = (g.landing_address(g.param_items[p][0]), got)
        return out

    def synchronize(self) -> None:
        """Waits for TIDE's enqueued GPU work and raises its errors (a CUDA run's collectives are
        enqueue-only; a peer's timeout surfaces here or from a later call). No-op on CPU."""
        sync = getattr(self._rt.transport, "synchronize", None)
        if sync is not None:
            sync()

    def disable(self) -> None:
        """Restores stock FSDP2 on every group; parameters move back to private storage. On every
        rank (on CUDA it waits for TIDE's work and then for every peer). Then releases TIDE's
        core objects (runtime.py [Note: runtime lifetime]). A no-op once released (also by the
        exit hook, after which the arena's memory may be gone)."""
        if not self.enabled or self._rt.released:
            self.enabled = False
            return
        self.enabled = False
        if isinstance(self._rt.transport, comm.CudaExecutorTransport):
            # Peers push into this rank's arena: once the model and handle are gone the fabric
            # frees it, so every rank's enqueued TIDE work must be done first (every rank calls
            # disable(), like enable()).
            self.synchronize()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
        served = [g for g in self._groups if g.eligible]
        for g in served:
            _deactivate(g)
        if served:
            _patches.uninstall()
            # The executor before the rail: calls it captured as CUDA graphs hold the rail's NCCL
            # work, and the communicator's teardown waits for them (exec/cuda/graph.h).
            if self._rt.transport is not None:
                self._rt.transport.close()
            self._rt.arena.close()
            # NCCL fabric: every rank is here, after the barrier above (its teardown is collective).
            self._rt.arena.close_fabric()
            close = getattr(self._rt.rail, "close", None)  # the NCCL rail: after the barrier above
            if close is not None:
                close()
        # Drops the executor, sessions, rail, views and the arena's fabric (runtime.py
        # [Note: runtime lifetime]): nothing of TIDE's is left for interpreter shutdown.
        self._rt.release()

    def __repr__(self) -> str:
        served = sum(g.eligible for g in self._groups)
        return (f"TideHandle(mode={self.mode}, groups={served}/{len(self._groups)} TIDE, "
                f"transport={self.transport}, enabled={self.enabled})")


def enable(model: nn.Module, *, mode: str = "in_place", topology: tide.Topology | None = None,
           transport: str = "auto", fabric: str = "auto", ring: bool = True,
           executor_options: tide.ExecutorOptions | None = None, rails: str = "auto",
           serve_single_rank: bool = False, **options: int) -> TideHandle:
    """Switches ``model``'s FSDP2 collectives to TIDE. Call after ``fully_shard`` and before (or
    between) training steps, on every rank.

    ``mode``: ``"in_place"`` reads gradients where autograd leaves them; ``"slot_reuse"`` copies
    them into the group's vacated all-gather slot. ``topology``: ``tide.Topology(nodes, L)``;
    default from ``LOCAL_WORLD_SIZE``. ``transport``: ``"auto"`` (TIDE's per-rank executor for
    the model's device: the CPU ``RankExecutor``, or on CUDA ``tide._core.cuda.RankExecutor`` over
    ``fabric``; a CUDA model on a build without the CUDA executor keeps stock FSDP2 collectives,
    one log line) or ``"executor"`` (the same, raising instead of falling back; see
    ``tide_torch/comm.py``). ``executor_options``: ``tide.ExecutorOptions`` of the executor (e.g.
    ``timeout_s``). ``fabric``: how the CUDA executor's ranks reach each other's arenas:
    ``"ipc"`` (``IpcFabric``, CUDA-IPC handles exchanged here),
    ``"nccl"`` (``NcclFabric``: the arena in an NCCL symmetric window, peers by LSA pointer,
    built collectively once the ranks agree; needs a CUDA model and the CUDA executor) or
    ``"auto"``: env ``TIDE_TORCH_FABRIC`` when set, else ``"ipc"`` (the NCCL fabric has run at
    world 1 only so far). All ranks must resolve the same fabric (agreed like the plans).
    ``ring``: share the two position-aware ring slots between resharding groups (default);
    ``False`` gives every group its own unsharded storage (needed when toggling
    ``set_reshard_after_backward`` during training). ``options``: planner knobs (``w_wave``,
    ``k``, ``n_part``, ``n_stg``, ``chunk_bytes``, ``sum_ctas``, ``land_ctas``). ``rails``: how a
    rank reaches other nodes: ``"two_sided"`` (it maps only its own node's arenas; every byte to
    another node is a send/recv on the rail: gloo on CPU), ``"one_sided"`` (every rank's arena by
    pointer: all ranks on one host) or ``"auto"``: two-sided when the topology has more than one
    node. Each rank's host (``NCCL_HOSTID`` or the hostname) is recorded: ranks of one topology
    node on different hosts, or one-sided rails across hosts, keep stock collectives (one log line
    per group) instead of failing later. ``serve_single_rank``: a job of one rank keeps stock
    FSDP2 (one log line) unless this is True: FSDP2 neither gathers nor reduces there, so TIDE
    saves no bytes (TIDE-RS would replace ``_chunk_cat`` by a pass over the same bytes) and its
    ring slots would only add memory (See [Note: world 1] in
    groups.py); True runs TIDE's path anyway (tests on one GPU).

    Groups outside TIDE's contract keep stock collectives (one ``tide_torch`` log line each).
    Ranks agree on plans before anything changes; on any disagreement or local failure every rank
    raises (``TideAgreementError`` or the local error).
    """
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    world = dist.get_world_size() if initialized else 1

    record: dict[str, Any] = {"rank": rank, "error": None, "topology": None, "groups": [],
                              "capabilities": None, "shm": None, "ipc": None,
                              "arena_bytes": 0, "nccl_id": None, "host": host_identity(), "rail_id": None}
    rails_ = "one_sided"
    groups: list[TideGroup] = []
    arena: Arena | None = None
    topo: tide.Topology | None = None
    device = torch.device("cpu")
    local_exc: BaseException | None = None
    try:
        # Arguments are checked here, inside the agreement: a rank whose arguments are wrong still
        # takes part in the one exchange below, so every rank raises together (nobody waits).
        _check_arguments(mode, rails, transport, options, executor_options, serve_single_rank,
                         ring)
        fabric = _resolve_fabric(fabric)
        _patches.require_supported_torch()
        groups = find_groups(model)
        topo = resolve_topology(topology, world)
        # Planner options: names, types and ranges on the job's topology, here, before any group
        # is planned (a bad value is the caller's error, raised on every rank: not a fallback).
        options = check_options(topo, mode, **options)
        rails_ = ("two_sided" if topo.nodes > 1 else "one_sided") if rails == "auto" else rails
        names = {id(p): n for n, p in model.named_parameters()}
        for g in groups:
            if id(g.pg.fsdp_params) in all_gather.REGISTRY:
                raise TideEnableError(f"TIDE is already enabled on group {g.fqn}: call "
                                      "handle.disable() before enabling again")
            plan_group(g, topo, mode, options, names)
            if g.eligible and not g.pg.is_sharded:
                raise TideEnableError(
                    f"group {g.fqn} is unsharded: call tide_torch.enable() between steps")
        served = [g for g in groups if g.eligible]
        if served and world == 1 and not serve_single_rank:
            for g in served:
                g.fall_back(SINGLE_RANK)
            served = []
        if served:
            device = served[0].pg.device
        if fabric == "nccl" and groups:
            _check_nccl_fabric(served[0].pg.device if served else groups[0].pg.device, transport)
        cuda_tide = device.type == "cuda" and (fabric == "nccl" or comm.cuda_executor_available())
        if device.type == "cuda" and not cuda_tide:
            why = ("this build of tide._core has no CUDA executor (built with TIDE_CUDA=off or "
                   "without nvcc) or no GPU is usable")
            if transport == "executor":
                raise TideEnableError(f"tide_torch.enable: transport='executor': {why}")
            for g in served:
                g.fall_back(why)
            served = []
        if served and device.type == "cuda" and rails_ == "two_sided" and fabric == "nccl":
            for g in served:
                g.fall_back(
                    "fabric='nccl' maps its LSA team, not one topology node: two-sided rails run on "
                    "fabric='ipc' (a node's peers by CUDA IPC, other nodes over the NCCL rail)")
            served = []
        if served:
            sizes = placement.assign(groups, use_ring=ring, rails=rails_)
            if fabric == "nccl":
                # Built collectively after the verdict (a rank that failed here must not leave
                # its peers inside NCCL's init): rank 0's unique id rides in the records.
                record["arena_bytes"] = arena_nbytes(sizes)
                if rank == 0:
                    record["nccl_id"] = tide._core.cuda.nccl_unique_id()
                else:
                    tide._core.cuda.nccl_version()  # loads libnccl here: a missing one fails now
            else:
                arena = Arena(sizes, device, rank=rank, world=world, fabric=cuda_tide)
            if device.type == "cuda" and rails_ == "two_sided" and rank < topo.gpus_per_node:
                record["rail_id"] = tide._core.cuda.nccl_unique_id()  # node 0 makes its local index's
        record.update(
            topology=(topo.nodes, topo.gpus_per_node),
            groups=[(g.fqn, g.status) for g in groups],
            capabilities={"torch": torch.__version__.split("+")[0], "mode": mode,
                          "layout_hook": _patches.has_all_gather_layout(),
                          "cuda_executor": cuda_tide,
                          "cuda": _cuda_capabilities(device) if cuda_tide else None,
                          "transport": transport, "fabric": fabric if cuda_tide else None,
                          "ring": ring, "rails": rails_},
            shm=arena.shm_name if arena is not None else None,
            ipc=arena.ipc_handle() if arena is not None else None)
    except Exception as e:  # noqa: BLE001 - reported to every rank before raising
        local_exc = e
        record["error"] = f"{type(e).__name__}: {e}"

    records = _exchange_or_close(record, arena)
    # [Note: peers unlink too] From here every rank knows the segment names of its host's ranks:
    # whoever gives up (or, after the mapping barrier, goes on) unlinks them all, not only its
    # own, so a rank killed after the first exchange leaves no segment behind (docs/architecture.md,
    # "Shared-memory segments"). Unlinking a name twice is harmless; mappings stay valid.
    peer_shm = [r["shm"] for r in records if r.get("shm") and r.get("host") == record["host"]]
    problems = agreement.verdict(records)
    if problems:
        _close_all(arena, peer_shm)
        if local_exc is not None:
            raise local_exc
        raise agreement.TideAgreementError(
            "tide_torch.enable(): TIDE stays off on every rank: " + "; ".join(problems))

    served = [g for g in groups if g.eligible]
    hosts = [r["host"] for r in records]
    why_hosts = node_host_problem(hosts, topo)
    if why_hosts is None and rails_ == "one_sided" and len(set(hosts)) > 1:
        why_hosts = (f"one-sided rails map every rank's arena, but the ranks are on {len(set(hosts))} hosts "
                     "(rails='two_sided' reaches other hosts through the rail)")
    if served and why_hosts is not None:  # the same verdict on every rank (same records)
        for g in served:
            g.fall_back(why_hosts)
        served = []
        if arena is not None:
            arena.close()
            arena = None
    if groups and all(g.fallback == SINGLE_RANK for g in groups):
        logger.warning("tide_torch: all %d groups use stock FSDP2 collectives: %s", len(groups), SINGLE_RANK)
    else:
        for g in groups:
            if not g.eligible:
                log_fallback(g)
    if served:
        # Mapping the peers' arenas (shm segments, CUDA IPC handles, the NCCL fabric) can fail
        # on one rank only: a second exchange makes every rank raise together (and is the
        # barrier after which every rank has mapped every peer's arena).
        err = None
        nccl = None
        rail = None
        try:
            opts = (executor_options or tide.ExecutorOptions()).replace(rails=rails_)
            if rails_ == "two_sided" and device.type == "cpu":
                rail = GlooRail(dist.new_group(backend="gloo"))  # collective: first, on every rank
            elif rails_ == "two_sided":  # collective over the ranks of this local index
                L = topo.gpus_per_node
                index = device.index if device.index is not None else torch.cuda.current_device()
                rail = tide._core.cuda.NcclRail(rank // L, topo.nodes, index, records[rank % L]["rail_id"],
                                                max_ctas=opts.rail_ctas,
                                                channels_per_peer=opts.rail_channels_per_peer,
                                                timeout_s=opts.timeout_s)  # construction's deadline
            if fabric == "nccl":  # every rank constructs it here, together
                nccl = make_nccl_fabric(
                    rank, world, device, max(r["arena_bytes"] for r in records),
                    next(r["nccl_id"] for r in records if r["rank"] == 0), topo.gpus_per_node)
                arena = Arena(sizes, device, nccl=nccl, nbytes=nccl.arena_bytes)
            placement.bind(groups, arena)
            L = topo.gpus_per_node
            # Two-sided rails: only this node's arenas are mapped (other nodes: the rail).
            mine = [rails_ == "one_sided" or r["rank"] // L == rank // L for r in records]
            arena.open_peers([r["ipc"] if m else b"" for r, m in zip(records, mine)])
            transport_ = comm.make_transport(
                arena, [r["shm"] if m else "" for r, m in zip(records, mine)], rank, topo,
                group_of=lambda g: g.pg.mesh_info.shard_process_group, options=opts, rail=rail)
        except Exception as e:  # noqa: BLE001 - reported to every rank before raising
            local_exc, err = e, f"{type(e).__name__}: {e}"
        after = _exchange_or_close({"rank": rank, "error": err, "nccl": nccl is not None}, arena, peer_shm)
        failed = [(r["rank"], r["error"]) for r in after if r["error"]]
        if failed:
            _close_all(arena, peer_shm)
            if nccl is not None and all(r["nccl"] for r in after):
                nccl.close()  # collective: every rank built it, every rank closes it
            # (A rank whose NcclFabric failed locally aborted its communicator; the others'
            # fabrics are left to their destructors.)
            if local_exc is not None:
                raise local_exc
            raise agreement.TideAgreementError(
                "tide_torch.enable(): TIDE stays off on every rank: " +
                "; ".join(f"rank {r} failed to map the peers' arenas: {e}" for r, e in failed))
        rt = Runtime(mode, groups, arena, device)
        rt.transport = transport_
        rt.rails, rt.rail = rails_, rail
        # Every rank has mapped every peer's segment (the exchange above is the barrier after
        # mapping): unlink the names now, the peers' too, so nothing outlives the processes.
        _close_all(arena, peer_shm)
        _patches.install(all_gather.foreach_all_gather, all_gather.foreach_all_gather_copy_out,
                         reduce_scatter.foreach_reduce, reduce_scatter.foreach_reduce_scatter_copy_in)
        for g in served:
            g.runtime = rt
            _activate(g)
    else:
        rt = Runtime(mode, groups, arena, device)
    logger.info("tide_torch: enabled %s on %d/%d groups (%s, %s)", mode, len(served), len(groups),
                topo, rt.transport.name if rt.transport else "stock")
    return TideHandle(rt, groups, topo)


SINGLE_RANK = ("a single-rank job: FSDP2 neither all-gathers nor reduce-scatters there, so TIDE has no "
               "collective to speed up and no bytes to save (its one pass would replace _chunk_cat's over "
               "the same bytes; tide_torch.enable(serve_single_rank=True) serves it anyway)")


def _check_arguments(mode, rails, transport, options, executor_options, serve_single_rank,
                     ring) -> None:
    if mode not in MODES:
        raise ValueError(f"tide_torch.enable: mode must be one of {MODES}, got {mode!r}")
    if rails not in RAILS:
        raise ValueError(f"tide_torch.enable: rails must be one of {RAILS}, got {rails!r}")
    if transport not in comm.TRANSPORTS:
        raise ValueError(f"tide_torch.enable: transport must be one of {comm.TRANSPORTS}, "
                         f"got {transport!r}")
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        raise TypeError(f"tide_torch.enable: unknown options {unknown}; known: {PLAN_OPTIONS}")
    if executor_options is not None and not isinstance(executor_options, tide.ExecutorOptions):
        raise TypeError(f"tide_torch.enable: executor_options must be a tide.ExecutorOptions, got "
                        f"{type(executor_options).__name__}")
    if not isinstance(ring, bool):
        raise TypeError(f"tide_torch.enable: ring must be a bool, got {ring!r}")
    if not isinstance(serve_single_rank, bool):
        raise TypeError(f"tide_torch.enable: serve_single_rank must be a bool, got {serve_single_rank!r}")


def _exchange_or_close(record: dict[str, Any], arena: Arena | None,
                       peer_shm: list[str] = ()) -> list[dict[str, Any]]:
    """agreement.exchange; when the exchange itself fails (a peer died inside enable(), the
    process group broke) this rank's arena is closed and the peers' segment names it knows are
    unlinked first (see [Note: peers unlink too])."""
    try:
        return agreement.exchange(record)
    except BaseException:
        _close_all(arena, peer_shm)
        raise


def _close_all(arena: Arena | None, peer_shm: list[str]) -> None:
    """Closes this rank's arena (unlinks its name) and unlinks the host's peers' segment names."""
    if arena is not None:
        arena.close()
    for name in peer_shm:
        shm.unlink(name)


def _resolve_fabric(fabric: str) -> str:
    """``enable(fabric=...)`` checked, ``"auto"`` resolved (env TIDE_TORCH_FABRIC, else "ipc")."""
    if fabric not in FABRICS:
        raise ValueError(f"tide_torch.enable: fabric must be one of {FABRICS}, got {fabric!r}")
    if fabric == "auto":
        fabric = env.torch_fabric() or "auto"
        if fabric not in FABRICS:
            raise ValueError(f"tide_torch.enable: fabric='auto' reads {FABRIC_ENV}, which must be "
                             f"one of {FABRICS}, got {fabric!r}")
    # "auto" is the CUDA-IPC fabric: the NCCL fabric has run at world 1 only so far.
    return "ipc" if fabric == "auto" else fabric


def _check_nccl_fabric(device: torch.device, transport: str) -> None:
    """fabric="nccl" needs a CUDA model, the CUDA executor, and a build that has both."""
    if device.type != "cuda":
        raise TideEnableError(f"tide_torch.enable: fabric='nccl' but the model is on {device}: "
                              "the NCCL fabric needs CUDA")
    why = nccl_fabric_api_error()
    if why is not None:
        raise TideEnableError(f"tide_torch.enable: fabric='nccl' is unavailable: {why}")


def _cuda_capabilities(device: torch.device) -> dict[str, Any]:
    """What ranks must agree on about their GPUs (the device index may differ per rank)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    caps = dict(tide._core.cuda.capabilities(index))
    caps.pop("device", None)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(caps.items())}


def _activate(g: TideGroup) -> None:
    for p, fp in enumerate(g.pg.fsdp_params):
        if hasattr(fp, "_unsharded_param"):
            # Built by an earlier stock all-gather: FSDP2 rebuilds it over the landing view.
            del fp._unsharded_param
        fp.all_gather_outputs = ([g.landing_views[i] for i in g.param_items[p]] if g.extension[p]
                                 else [g.param_landing[p]])
        _patches.patch_param_free(fp, free_in_arena(g, p))
        if g.world == 1:  # See [Note: world 1] in groups.py
            _patches.patch_param_init_outputs(fp, all_gather.init_outputs_at_world_1(g, p))
        if g.param_resident[p] is not None:  # its chunk adopts its shards
            all_gather.adopt_shard(g, p)
    g.pg._reduce_scatter_comm = reduce_scatter.TideReduceScatter(g, g.pg._reduce_scatter_comm)
    if _patches.copy_out_seam():
        g.previous_copy_out = _patches.set_copy_out(
            g.pg, all_gather.copy_out_for(g.pg._all_gather_output_fn))
    all_gather.REGISTRY[id(g.pg.fsdp_params)] = g


def _deactivate(g: TideGroup) -> None:
    all_gather.REGISTRY.pop(id(g.pg.fsdp_params), None)
    if not g.pg.is_sharded:
        g.pg._to_sharded()
    comm_ = g.pg._reduce_scatter_comm
    if isinstance(comm_, reduce_scatter.TideReduceScatter):
        g.pg._reduce_scatter_comm = comm_.previous
    if g.previous_copy_out is not None:
        _patches.set_copy_out(g.pg, g.previous_copy_out)
        g.previous_copy_out = None
    all_gather.release_landing(g)
    for p in range(len(g.pg.fsdp_params)):
        all_gather.unadopt_shard(g, p)
