"""Per-model runtime state shared by the AG and RS faces: arena, transport, ring-slot ownership.

[Note: ring-slot ownership]
A ring slot belongs to the group that last landed in it. Before group g lands, the previous
owner must be resharded (its unsharded parameters are dead) — FSDP2's prefetch depth of 1 makes
that true for groups in slot g mod 2 — and, under Slot-Reuse, the reduce-scatter that reads the
previous owner's gradients out of the slot must have finished: the copy-in stream waits for the
event recorded after that reduce-scatter. A violated assumption raises instead of silently
overwriting live parameters. The one tolerated case is the folded ring tail under no-grad
evaluation (App. F): it stays unsharded after forward, so TIDE reshards it before reusing its slot.
"""
from __future__ import annotations

import logging
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
                                            ag_early=0)
        # (group, "ag" | "rs", reason) -> calls handed to stock FSDP2 (handle.hand_backs)
        self.hand_backs: Counter = Counter()
        self._owner: dict[str, Any] = {}
        self._release_events: dict[str, list[Any]] = {}
        self._events = device.type != "cpu"  # CPU streams are synchronous
        self._by_pg = {id(g.pg): g for g in groups if g.eligible}
        self._tail = max((g for g in groups if g.eligible and g.slot.startswith("ring")),
                         key=lambda g: g.ring_index, default=None)

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

    def acquire_slot(self, tg: Any, stream: Any) -> bool:
        """Called on the copy-in stream before tg lands. See [Note: ring-slot ownership].
        Returns False when tg cannot land in its slot (it has moved to its own storage: this
        and later all-gathers are stock FSDP2's, see [Note: ring depth] in placement.py)."""
        key = self._key(tg)
        owner = self._owner.get(key)
        if owner is not None and owner is not tg and _is_live(owner):
            if (owner is self._tail and not torch.is_grad_enabled()
                    and tg.pg._training_state == _patches.TrainingState.FORWARD
                    and owner.pg._training_state == _patches.TrainingState.IDLE
                    and owner.pg._all_gather_result is None):
                owner.pg.reshard()  # the folded ring tail, during no-grad evaluation
            else:
                self.move_to_own_storage(
                    tg, f"its ring slot {tg.slot} still holds group {owner.fqn} (more groups "
                    "unsharded at once than the prefetch lists at enable() said)")
                return False
        for event in self._release_events.pop(key, ()):
            stream.wait_event(event)
        self._owner[key] = tg
        return True

    def move_to_own_storage(self, tg: Any, why: str) -> None:
        """tg (sharded: about to land) leaves the arena's landing for FSDP2's own storage: its
        all-gathers go to stock from now on (counted per call); its reduce-scatters stay TIDE-RS
        reading autograd's gradients (In-Place). One log line."""
        from tide_torch import all_gather
        all_gather.release_landing(tg)
        tg.ag_stock_reason = f"moved to its own storage: {why}"
        logger.warning("tide_torch: group %s %s", tg.fqn, tg.ag_stock_reason)

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
        return (tg.ag_stock_reason is None and self._owner.get(self._key(tg)) is tg
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
        if p == 0:  # once per group reshard
            tg.runtime.release_slot_after_compute(tg)
    return free_unsharded_param
