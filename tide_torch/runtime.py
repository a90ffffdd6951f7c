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

from collections import Counter
from typing import Any

import torch
from torch.distributed.device_mesh import _get_device_handle

from tide_torch import _patches


class Runtime:
    def __init__(self, mode: str, groups: list[Any], arena: Any, device: torch.device):
        self.mode = mode
        self.groups = groups
        self.arena = arena
        self.device = device
        self.transport: Any = None
        self.stats: Counter = Counter(ag_tide=0, ag_stock=0, rs_tide=0, rs_stock=0)
        self._owner: dict[str, Any] = {}
        self._release_events: dict[str, list[Any]] = {}
        self._events = device.type != "cpu"  # CPU streams are synchronous
        self._tail = max((g for g in groups if g.eligible and g.slot.startswith("ring")),
                         key=lambda g: g.ring_index, default=None)

    @staticmethod
    def _key(tg: Any) -> str:
        return tg.slot if tg.slot != "fixed" else f"fixed:{tg.index}"

    def acquire_slot(self, tg: Any, stream: Any) -> None:
        """Called on the copy-in stream before tg lands. See [Note: ring-slot ownership]."""
        key = self._key(tg)
        owner = self._owner.get(key)
        if owner is not None and owner is not tg and _is_live(owner):
            if (owner is self._tail and not torch.is_grad_enabled()
                    and tg.pg._training_state == _patches.TrainingState.FORWARD
                    and owner.pg._training_state == _patches.TrainingState.IDLE
                    and owner.pg._all_gather_result is None):
                owner.pg.reshard()  # the folded ring tail, during no-grad evaluation
            else:
                raise RuntimeError(
                    f"tide_torch: group {tg.fqn} would land in ring slot {tg.slot} while group "
                    f"{owner.fqn} is still unsharded there. TIDE's 2-slot ring assumes FSDP2's "
                    "prefetch depth 1, module order = execution order, and groups that reshard "
                    "after backward (set_reshard_after_backward before enable()); use "
                    "tide_torch.enable(..., ring=False) to give every group its own storage")
        for event in self._release_events.pop(key, ()):
            stream.wait_event(event)
        self._owner[key] = tg

    def slot_is_free(self, tg: Any) -> bool:
        """Whether tg's own landing storage may hold its gradients (Slot-Reuse)."""
        return self._owner.get(self._key(tg)) is tg and tg.pg.is_sharded

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
