"""Checkpoints of a tide_xla run (docs/xla.md, "Checkpoints and export"): the leaf shapes a
checkpoint was saved from, and a restore that refuses another model's checkpoint.

orbax saves the padded shards (N R_p, ...) as they are; restoring them on another device count
needs `strict=False`, which truncates or zero-pads every dimension to the target's, so a
checkpoint of another model (a leaf (41, 8) restored into (37, 8), or (37, 9) into (37, 8))
would come back silently wrong. The padded shapes alone cannot tell (48 saved rows are
(41, 8) at N = 8 or (37, 8) at N = 12), so the save records each leaf's unpadded shape in the
checkpoint's custom metadata, and the restore compares them with the layout first:

    ckpt.save(path, {"shards": shards, "opt": opt_state},
              custom_metadata=tide_xla.checkpoint_metadata(layout))
    got = tide_xla.restore(ckpt, path, {"shards": target, "opt": opt_target}, layout)

`restore` raises ValueError naming the first leaf whose shape (or presence) differs, before any
byte is read; `check_checkpoint(metadata, layout)` is the check alone. Orbax is the caller's:
nothing here imports it (any checkpointer with `metadata(path).custom_metadata` and
`restore(path, target, strict=False)`).
"""
from __future__ import annotations

from typing import Any

KEY = "tide_xla"
VERSION = 1


def checkpoint_metadata(layout, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Custom metadata for `ckpt.save(..., custom_metadata=...)`: each leaf's unpadded shape and
    dtype, keyed by its path (JSON: lists and strings). `extra`: the caller's own entries."""
    record = {"version": VERSION, "world": int(layout.world),
              "leaves": {l.path: {"shape": [int(d) for d in l.shape],
                                  "dtype": str(l.dtype) if l.dtype is not None else None}
                         for l in layout.leaves}}
    out = dict(extra or {})
    out[KEY] = record
    return out


def _record(metadata: Any) -> dict[str, Any]:
    custom = getattr(metadata, "custom_metadata", metadata)
    if not isinstance(custom, dict) or not isinstance(custom.get(KEY), dict):
        raise ValueError("tide_xla.check_checkpoint: the checkpoint has no tide_xla leaf shapes "
                         "(saved without custom_metadata=tide_xla.checkpoint_metadata(layout)), "
                         "so they cannot be checked against the layout; save it with them, or "
                         "restore it yourself (orbax's strict=False truncates or zero-pads "
                         "whatever differs)")
    rec = custom[KEY]
    leaves = rec.get("leaves")
    if rec.get("version") != VERSION or not isinstance(leaves, dict):
        raise ValueError(f"tide_xla.check_checkpoint: the checkpoint's tide_xla metadata has "
                         f"version {rec.get('version')!r}, this tide_xla reads version {VERSION}")
    return leaves


def check_checkpoint(metadata: Any, layout) -> None:
    """Refuses (ValueError naming the leaf) a checkpoint whose leaves are not the layout's:
    a leaf missing on either side, or saved with another unpadded shape. `metadata`: the
    checkpoint's custom metadata dict, or what `ckpt.metadata(path)` returns."""
    saved = _record(metadata)
    ours = {l.path: tuple(l.shape) for l in layout.leaves}
    for path, shape in ours.items():
        if path not in saved:
            raise ValueError(f"tide_xla.check_checkpoint: leaf {path} {shape} of the layout is not "
                             f"in the checkpoint (it has {len(saved)} leaves: another model?)")
        got = saved[path].get("shape") if isinstance(saved[path], dict) else None
        if not isinstance(got, list) or tuple(got) != shape:
            raise ValueError(f"tide_xla.check_checkpoint: leaf {path} was saved with shape "
                             f"{tuple(got) if isinstance(got, list) else got!r}, the layout's is "
                             f"{shape}: a checkpoint of another model (a strict=False restore "
                             f"would truncate or zero-pad it silently)")
    extra = sorted(set(saved) - set(ours))
    if extra:
        raise ValueError(f"tide_xla.check_checkpoint: the checkpoint has leaves the layout does "
                         f"not: {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} "
                         f"(another model?)")


def restore(checkpointer: Any, path: Any, target: Any, layout, **restore_kwargs: Any) -> Any:
    """`check_checkpoint(checkpointer.metadata(path), layout)`, then
    `checkpointer.restore(path, target, strict=False, **restore_kwargs)`: dim 0 re-padded for
    this mesh's N (docs/xla.md), every other difference refused first, naming the leaf."""
    check_checkpoint(checkpointer.metadata(path), layout)
    restore_kwargs.setdefault("strict", False)
    return checkpointer.restore(path, target, **restore_kwargs)
