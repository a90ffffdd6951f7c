"""Planner face: Topology, GroupSignature and plan() over tide._core."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tide import _core


@dataclass(frozen=True)
class Topology:
    """M nodes x L GPUs per NVSwitch domain; node-major rank r = n*L + l."""

    nodes: int = 1
    gpus_per_node: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class GroupSignature:
    """One FSDP2 parameter group: unsharded shapes (dim-0 sharded) and dtypes."""

    shapes: Sequence[Sequence[int]]
    ag_dtype: str = "bfloat16"
    grad_dtype: str = "bfloat16"
    shard_dtype: str | None = None  # None: same as ag_dtype (no cast)
    names: Sequence[str] = field(default_factory=tuple)


def plan(sig: GroupSignature, topo: Topology, mode: str = "in_place", *, w_wave: int = 0,
         k: int = 0, n_part: int = 1, n_stg: int = 2, chunk_bytes: int = 0, sum_ctas: int = 0,
         land_ctas: int = 0):
    """Plan one group on one topology; raises tide.PlanError naming the field at fault."""
    shapes = []
    for i, s in enumerate(sig.shapes):
        try:
            dims = [int(d) for d in s]
        except TypeError as e:
            raise _core.PlanError(f"GroupSignature.shapes[{i}]: {s!r} is not a sequence of ints") from e
        for j, d in enumerate(s):
            if int(d) != d:
                raise _core.PlanError(f"GroupSignature.shapes[{i}][{j}]: {d!r} is not an integer")
        shapes.append(dims)
    return _core.make_plan(
        shapes, list(sig.names), sig.ag_dtype, sig.grad_dtype, sig.shard_dtype or sig.ag_dtype,
        int(topo.nodes), int(topo.gpus_per_node), mode, w_wave, k, n_part, n_stg, chunk_bytes,
        sum_ctas, land_ctas)
