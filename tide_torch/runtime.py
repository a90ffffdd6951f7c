"""Per-model runtime state shared by the AG and RS faces: arena, transport, ring-slot ownership.

[Note: ring-slot ownership]
A ring slot belongs to the group that last landed in it. Before group g lands, the previous
owner must be resharded (its unsharded parameters are dead) — FSDP2's prefetch depth of 1 makes
that true for groups in slot g mod 2 — and, under Slot-Reuse, the reduce-scatter that reads the
previous owner's gradients out of the slot must have finished: the copy-in stream waits for the
event recorded after that reduce-scatter. A violated assumption never overwrites live
parameters: the landing group moves to its own storage where it still may (and gives up the
slot: a moved group never owns one), and raises where it may not (placement.py
[Note: ring depth]). The one tolerated case is the folded ring tail under
no-grad evaluation (App. F): it stays unsharded after forward, so TIDE reshards it before reusing
its slot.

[Note: runtime lifetime]
A runtime holds this rank's tide._core objects: the transport's executor and sessions, the rail,
the arena's fabric (whose memory peers push into), and its groups' plans. They are released in
order, never left to interpreter shutdown (nanobind reports instances still alive then, and a
fabric freed after CUDA's teardown is not freed in order):

- ``TideHandle.disable()`` (every rank, after its synchronize and, on CUDA with world > 1, the
  barrier) calls ``release()``: the transport closes (executor and sessions dropped; a later call
  raises), the rail is dropped, the groups' arena views and the arena's reference to its fabric
  are dropped. The CUDA-IPC fabric is then freed with its last view (arena.py
  [Note: fabric lifetime]); the NCCL fabric was closed collectively just before.
- Interpreter exit: an atexit hook (registered at import, so it runs before torch's hooks and
  before module teardown) synchronizes the transport of every runtime not yet released and calls
  ``release(at_exit=True)`` on every runtime alive (a handle, model or tensor may outlive module
  teardown: held by C++, or by the user), which also aborts an open NCCL rail (local) and drops
  the groups' plans; then every arena view lets go of its fabric (arena.detach_views(): the
  process is ending, views dangle from here, and nothing may run TIDE work after it). There is no
  barrier at exit (peers may be gone): a job that needs the peers' pushes ordered before the free
  calls ``disable()`` on every rank. An NCCL fabric still open at exit is kept (its teardown is
  collective): disable() frees it.
"""
from __future__ import annotations

import atexit
import logging
import weakref
from collections import Counter
from typing import Any

import torch
from torch.distributed.device_mesh import _get_device_handle

from tide_torch import _patches

logger = logging.getLogger("tide_torch")

class Runtime:
    # [Note: early backward all-gather]
    # FSDP2's post_backward(l) enqueues l's reduce-scatter before the next pre_backward enqueues
    # the next all-gather, which can then wait behind l's whole network phase (paper §5.2,
    # "backward prefetch inversion"). Under In-Place, l's landing slot is free once l has
    # resharded (its gradients stay in autograd's storage), so TIDE issues that next all-gather
    # from l's reduce-scatter copy-in, ahead of the reduce-scatter: the same target FSDP2 would
    # prefetch next (post_forward_order[j - 1], j the latest forward invocation still waiting
    # for its backward, as FSDP2's _backward_prefetch pops it), through FSDP2's own
    # _prefetch_unshard, so FSDP2's later prefetch of it is a no-op. Only when that target lands
    # in the slot l just released; never with explicit prefetch lists, at world 1 or under
    # Slot-Reuse (the slot then holds l's gradients until the reduce-scatter has read them).

    def __init__(self, mode: str, groups: list[Any], arena: Any, device: torch.device):
        self.mode = mode
        self.groups = groups
        self.arena = arena
        self.device = device
        self.transport: Any = None
        self.rails = "one_sided"  # the executor's (enable() sets it)
        self.rail: Any = None      # two-sided: GlooRail (CPU) or tide._core.cuda.NcclRail
        self.stats: Counter = Counter(ag_tide=0, ag_stock=0, rs_tide=0, rs_stock=0,
                                      ag_early=0, ag_post_forward=0, ag_pull_chunks=0,
                                      ag_own_storage=0)
        # (group, "ag" | "rs", reason) -> calls handed to stock FSDP2 (handle.hand_backs)
        self.hand_backs: Counter = Counter()
        self._owner: dict[str, Any] = {}
        self._release_events: dict[str, list[Any]] = {}
        self._events = device.type != "cpu"  # CPU streams are synchronous
        self._by_pg = {id(g.pg): g for g in groups if g.eligible}
        self._tail = max((g for g in groups if g.eligible and g.slot.startswith("ring")),
                         key=lambda g: g.ring_index, default=None)
        ring = [g for g in groups if g.eligible and g.ring_index >= 0]
        self.ring_slots = len({g.slot for g in ring})
        self._ring_shared = len(ring) > self.ring_slots  # some slot holds several groups
        self._depth: int | None = None  # the prefetch lists' ring depth, read per iteration
        self.released = False
        _RUNTIMES.add(self)

    def release(self, *, at_exit: bool = False) -> None:
        """Drops this runtime's tide._core objects (see [Note: runtime lifetime]). Its caller has
        made sure no TIDE work is pending (disable(): synchronize and barrier; exit: synchronize).
        Idempotent; ``at_exit`` also drops the groups' plans."""
        rail, self.rail = self.rail, None
        if at_exit and getattr(rail, "closed", True) is False:  # an NcclRail still open
            rail.abort("tide_torch: interpreter exit")  # ncclCommAbort: local, never waits for peers
        if self.transport is not None:
            self.transport.close()
        for g in self.groups:
            g.landing_views, g.resident_views, g.input_views = [], [], []
            g.param_landing, g.param_resident = [], []
            if at_exit:
                g.chunks, g.rs_chunks, g.sub_plans, g.rs_bound = [], [], {}, None
        if self.arena is not None:
            self.arena.release()
        self.released = True

    def hand_back(self, tg: Any, collective: str, reason: str) -> None:
        """One call of ``tg``'s collective ("ag" or "rs") goes to stock FSDP2: counted in
        ``stats`` and ``hand_backs``, logged once per group, collective and reason."""
        self.stats[f"{collective}_stock"] += 1
        key = (tg.fqn, collective, reason)
        if key not in self.hand_backs:
            what = "all-gathers" if collective == "ag" else "reduce-scatters"
            logger.warning("tide_torch: group %s hands %s to stock FSDP2: %s", tg.fqn, what, reason)
        self.hand_backs[key] += 1

    @staticmethod
    def _key(tg: Any) -> str:
        return tg.slot if tg.slot != "fixed" else f"fixed:{tg.index}"

    def acquire_slot(self, tg: Any, stream: Any, *, copy_out: bool = False) -> bool:
        """Called on the copy-in stream before tg lands. See [Note: ring-slot ownership].
        Returns False when tg does not land in its slot: it has moved to its own storage (this
        and later all-gathers land there, see [Note: ring depth] in placement.py).
        ``copy_out``: called from tg's own copy-out (world 1), whose pending all-gather result
        is this landing, not a live one."""
        if tg.ring_index >= 0 and _may_move(tg, copy_out):
            why = self._ring_outgrown(tg)
            if why is not None:
                self.move_to_own_storage(tg, why)
                return False
        key = self._key(tg)
        owner = self._owner.get(key)
        if owner is not None and owner is not tg and _is_live(owner):
            if (owner is self._tail and not torch.is_grad_enabled()
                    and tg.pg._training_state == _patches.TrainingState.FORWARD
                    and owner.pg._training_state == _patches.TrainingState.IDLE
                    and owner.pg._all_gather_result is None):
                owner.pg.reshard()  # the folded ring tail, during no-grad evaluation
            elif _may_move(tg, copy_out):
                self.move_to_own_storage(tg, f"its ring slot {tg.slot} still holds group "
                                             f"{owner.fqn} (more groups unsharded at once than "
                                             "the ring has slots)")
                return False
            else:
                # tg's unsharded tensors from its forward are saved for backward at this slot's
                # address: neither tg nor the owner can move now (see [Note: ring depth]).
                raise RuntimeError(
                    f"tide_torch: group {tg.fqn} would land in ring slot {tg.slot} while group "
                    f"{owner.fqn} is still unsharded there, between {tg.fqn}'s forward and its "
                    f"backward: autograd saved {tg.fqn}'s unsharded parameters at that slot's "
                    f"address, so neither group can move. Reshard {owner.fqn} before "
                    f"{tg.fqn}'s backward (no manual unshard() in between), set prefetch lists "
                    "and set_reshard_after_backward before enable(), or use "
                    "tide_torch.enable(..., ring=False) to give every group its own storage")
        for event in self._release_events.pop(key, ()):
            stream.wait_event(event)
        self._owner[key] = tg
        return True

    def _ring_outgrown(self, tg: Any) -> str | None:
        """Why tg can no longer share the ring (checked when it may still move), or None."""
        if not tg.pg.reshard_after_backward:
            return "it no longer reshards after backward (set_reshard_after_backward(False))"
        if tg.ring_index == 0 or self._depth is None:
            # The prefetch lists are read once per iteration (the first ring group's landing),
            # not at every landing: a walk over every group's FSDP state.
            from tide_torch.placement import ring_depth
            self._depth = ring_depth([g for g in self.groups if g.eligible])
        depth = self._depth
        if depth > self.ring_slots and self._ring_shared:
            return (f"the prefetch lists now keep {depth} groups unsharded, the ring has "
                    f"{self.ring_slots} slots (set prefetch lists before enable())")
        return None

    def move_to_own_storage(self, tg: Any, why: str) -> None:
        """tg leaves the arena's landing for FSDP2's own storage before it lands (only where
        ``_may_move``: nothing refers to its landing) and gives up its ring slot. From now on its
        all-gathers land in that storage through TIDE-AG where they pull, and go to stock where
        they push (all_gather.py ``own_storage_stock_reason``, counted per call); its
        reduce-scatters stay TIDE-RS reading autograd's gradients. One log line."""
        from tide_torch import all_gather
        all_gather.release_landing(tg)
        tg.moved = why
        for key in [k for k, owner in self._owner.items() if owner is tg]:
            del self._owner[key]  # its slot's release events stay for the next owner
        if tg.world == 1:  # FSDP2 allocates the outputs (all_gather.py init_outputs_at_world_1)
            for p, fp in enumerate(tg.pg.fsdp_params):
                _patches.patch_param_init_outputs(fp, all_gather.init_outputs_at_world_1(tg, p))
        stock = all_gather.own_storage_stock_reason(tg, False) if tg.world > 1 else None
        logger.warning("tide_torch: group %s moved to its own storage: %s; %s", tg.fqn, why,
                       "its all-gathers land there through TIDE-AG (pull landing)"
                       if stock is None else "its all-gathers go to stock FSDP2")

    def issue_early_all_gather(self, tg: Any) -> None:
        """See [Note: early backward all-gather]. Called on the compute stream from tg's
        reduce-scatter copy-in, after tg resharded and before its reduce-scatter is enqueued."""
        pg = tg.pg
        if (self.mode != "in_place" or tg.world == 1 or not tg.slot.startswith("ring")
                or tg.siblings != 1
                or pg._training_state != _patches.TrainingState.POST_BACKWARD
                or not pg.is_sharded or self._owner.get(self._key(tg)) is not tg
                or _patches.compiled_autograd_enabled()
                or any(getattr(g.state, "_states_to_backward_prefetch", None)
                       for g in self.groups)):
            return
        order = getattr(getattr(pg, "comm_ctx", None), "post_forward_order", None)
        pending = [idx[-1] for g in (order or ())
                   if (idx := getattr(g, "_post_forward_indices", None))]
        if not pending or max(pending) < 1:
            return
        target_pg = order[max(pending) - 1]
        target = self._by_pg.get(id(target_pg))
        if (target is None or target is tg or target.slot != tg.slot or not target_pg.is_sharded
                or target_pg._all_gather_result is not None):
            return
        _patches.FSDPParamGroup._prefetch_unshard(target_pg, "backward")
        if target_pg._all_gather_result is not None:
            self.stats["ag_early"] += 1

    def slot_is_free(self, tg: Any) -> bool:
        """Whether tg's own landing storage may hold its gradients (Slot-Reuse)."""
        return (tg.moved is None and self._owner.get(self._key(tg)) is tg
                and tg.pg.is_sharded)

    def hold_slot_for_grads(self, tg: Any) -> None:
        self._owner[self._key(tg)] = tg

    def release_slot_after_rs(self, tg: Any) -> None:
        """On the reduce-scatter stream, after TIDE-RS has read the gradients out of the slot."""
        self._record_release(tg)

    def release_slot_after_compute(self, tg: Any) -> None:
        """On the compute stream when tg reshards: its last reader of the slot was enqueued."""
        self._record_release(tg)

    def _record_release(self, tg: Any) -> None:
        if not self._events:
            return
        handle = _get_device_handle(self.device.type)
        self._release_events.setdefault(self._key(tg), []).append(
            handle.current_stream().record_event())


def _may_move(tg: Any, copy_out: bool = False) -> bool:
    """Whether tg's landing may move now: nothing saved for backward refers to it (no autograd,
    or tg has not run its forward of this iteration yet) and it is not unsharded (``copy_out``:
    its pending all-gather result is the landing being made)."""
    pg = tg.pg
    live = pg.is_unsharded or (pg._all_gather_result is not None and not copy_out)
    if live or pg._training_state not in (_patches.TrainingState.IDLE,
                                                  _patches.TrainingState.FORWARD):
        return False
    if not torch.is_grad_enabled():
        return True
    order = getattr(getattr(pg, "comm_ctx", None), "post_forward_order", None) or ()
    return not any(g is pg for g in order)


def _is_live(tg: Any) -> bool:
    pg = tg.pg
    return pg.is_unsharded or pg._all_gather_result is not None


def free_in_arena(tg: Any, p: int) -> Any:
    """Per-instance FSDPParam.free_unsharded_param for parameters living in the arena: the ring
    slot is released logically (ownership), the storage keeps its size.

    [Note: slot release on the compute stream]
    Stock FSDP2 frees unsharded storage to the caching allocator, which orders its reuse after
    the compute stream's readers. A ring slot is reused by TIDE itself, so the release is an
    event recorded on the compute stream here (FSDP2 reshards on the compute stream), which the
    next landing in the slot waits for in acquire_slot."""
    def free_unsharded_param() -> None:
        if _patches.compiled_autograd_enabled():
            raise RuntimeError("tide_torch does not support compiled autograd; disable TIDE")
        if tg.extension[p]:  # its own unsharded storage, not the landing (extensions.py)
            from tide_torch import extensions
            extensions.free_inner_tensors(tg.pg.fsdp_params[p], tg.runtime.arena)
        if p == 0:  # once per group reshard
            tg.runtime.release_slot_after_compute(tg)
    return free_unsharded_param


# Every runtime alive (see [Note: runtime lifetime]).
_RUNTIMES: "weakref.WeakSet[Runtime]" = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Releases what live runtimes still hold, after their enqueued TIDE work (See
    [Note: runtime lifetime])."""
    for rt in list(_RUNTIMES):
        sync = None if rt.released else getattr(rt.transport, "synchronize", None)
        try:
            if sync is not None:
                sync()
        except Exception as e:  # noqa: BLE001 - exiting anyway: report, then free
            logger.warning("tide_torch: at exit, TIDE's pending work failed: %s", e)
        try:
            rt.release(at_exit=True)
        except Exception as e:  # noqa: BLE001 - one runtime's failure must not keep the others
            logger.warning("tide_torch: at exit, releasing TIDE's runtime failed: %s", e)
    from tide_torch import arena
    arena.detach_views()
