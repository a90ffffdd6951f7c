"""Cross-rank agreement on plans and capabilities before anything is switched on.

Every rank contributes one record (its plan hashes and slots per group, its topology, torch and
transport capabilities, its arena's shared-memory name, and any local error) through a single
``all_gather_object``. Because that one collective is the only one, a rank that failed locally
still takes part, and every rank reaches the same verdict from the same records: all enable TIDE,
or all raise ``TideAgreementError`` naming the differing ranks and groups. Nobody hangs.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tide import ranks


class TideAgreementError(RuntimeError):
    """Ranks disagree on TIDE's plans or capabilities, or some rank failed to plan."""


def exchange(record: dict[str, Any], group: Any = None) -> list[dict[str, Any]]:
    if not dist.is_available() or not dist.is_initialized():
        return [record]
    world = dist.get_world_size(group)
    if world == 1:
        return [record]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, record, group=group)
    return out


def verdict(records: list[dict[str, Any]]) -> list[str]:
    """Problems found (empty: all ranks agree). Identical on every rank (tide.ranks.verdict)."""
    return ranks.verdict(records, ("topology", "capabilities"), groups="FSDP groups")
