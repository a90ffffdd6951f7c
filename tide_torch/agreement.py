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


_COMPARED = ("topology", "capabilities")


def verdict(records: list[dict[str, Any]]) -> list[str]:
    """Problems found (empty: all ranks agree). Identical on every rank."""
    problems = []
    errors = [(r["rank"], r["error"]) for r in records if r.get("error")]
    for rank, err in errors:
        problems.append(f"rank {rank} failed: {err}")
    if errors:
        return problems
    ref = records[0]
    for rec in records[1:]:
        for key in _COMPARED:
            if rec[key] != ref[key]:
                problems.append(f"rank {rec['rank']} has {key} {rec[key]} but rank "
                                f"{ref['rank']} has {ref[key]}")
        a, b = ref["groups"], rec["groups"]
        if len(a) != len(b):
            problems.append(f"rank {rec['rank']} has {len(b)} FSDP groups but rank "
                            f"{ref['rank']} has {len(a)}")
            continue
        for i, ((fa, sa), (fb, sb)) in enumerate(zip(a, b)):
            if (fa, sa) != (fb, sb):
                problems.append(f"group {i}: rank {ref['rank']} has {fa} {sa}, rank "
                                f"{rec['rank']} has {fb} {sb}")
    return problems
