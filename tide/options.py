"""Executor options: every knob of TIDE's executors, a frozen value set when an executor is made.

The fields and their ranges are the core's (``csrc/include/tide/exec_options.h``); constructing
an ``ExecutorOptions`` validates them there, so a bad value raises ``tide.PlanError`` naming the
field. Environment variables are debug overrides only, applied by the core when an executor is
created: ``TIDE_DEBUG=1`` (trace) and ``TIDE_EXEC_OPTIONS="field=value,..."``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from tide import _core


@dataclass(frozen=True)
class ExecutorOptions:
    timeout_s: float = 30.0            # every wait's deadline (fail-stop), seconds, (0, 1e6]
    cast_ctas: int = 32                # CUDA: CAST (mixed-precision all-gather), 1..4096
    zero_ctas: int = 8                 # CUDA: ZERO (stale inbox blocks), 1..4096
    cta_split: str = "auto"            # CUDA: SUM/REDUCE work split: auto | tiles | ranges
    full_grid: str = "tiles"           # CUDA: a whole-wave budget in tiles: tiles | wave
    copy_lanes: int = 4                # CUDA: streams a large COPY/PUT is spread over, 1..8
    copy_spread_bytes: int = 8 << 20   # CUDA: an op moving fewer bytes stays on its stream, >= 0
    copy_2d: str = "batch"             # CUDA: eager 2-D copies: batch | per_copy
    copies_on: str = "auto"            # CUDA: where copies run: auto | copy_engines | sms
    copy_ctas: int = 32                # CUDA: CTAs of one op's copies on SMs, 1..4096
    graphs: bool = False               # CUDA: replay repeated calls as CUDA graphs (one launch per call)
    sync_every_call: bool = False      # CUDA, debug: synchronise after every call
    issue_gate: bool = True            # CUDA rank executors sharing a process: enqueue in one order (off: diagnosis)
    staging_canary: bool = False       # CUDA in-process executor, debug: check staged pushes and SUMs for races
    trace: bool = False                # CPU: every executed op per rank to stderr
    workers: int = 0                   # CPU virtual cluster threads, 0..1024 (0: min(ranks, 4))
    rails: str = "one_sided"           # other nodes: one_sided (by pointer) | two_sided (rail send/recv)
    rail_ctas: int = 2                 # CUDA two-sided: SMs a rail group's NCCL kernel may take, 1..64
    rail_channels_per_peer: int = 1    # CUDA two-sided: NCCL channels per rail peer, 1..32

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = {"bool": bool, "int": int, "float": (int, float), "str": str}[f.type]
            if not isinstance(value, kind) or (isinstance(value, bool) and f.type != "bool"):
                raise _core.PlanError(f"ExecutorOptions.{f.name}: {value!r} has the wrong type "
                                      f"(expected {f.type})")
        _core.executor_options(self.as_dict())  # the core's validation, naming the field

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> "ExecutorOptions":
        return replace(self, **changes)

    def effective(self) -> str:
        """What an executor created now runs with: these options with TIDE_DEBUG /
        TIDE_EXEC_OPTIONS applied ('field=value,...')."""
        return _core.executor_options_with_debug_env(self.as_dict())
