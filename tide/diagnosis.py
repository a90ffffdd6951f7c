"""Survivors' diagnosis: after a TIDE timeout, every surviving rank names the rank that stopped.
Written once for the faces; each hands in its framework's key-value store (tide_torch: torch's
default store, in tide_torch/comm.py; tide_xla: jax.distributed's client through ``DirStore``,
run from the FFI handler that timed out, in tide_xla/processes.py).

A rank's own timeout message follows its wait chain only as far as it can see (paper §4.3,
fail-stop): with two-sided rails, rank 0 of a 2 x 2 job sees rank 2 (its rail peer) behind but
not why; rank 2 sees that rank 3 never posted. So each survivor, on a ``tide.TimeoutError``:

1. posts its root (the rank its chain ends at) to the job's key-value store — the one channel
   that still works when a peer is gone (a collective would wait for it);
2. follows the roots other survivors posted, for at most ``grace_s`` after its own timeout, until
   it reaches a rank that posted nothing (that rank stopped: dead, hung outside TIDE, or never
   called) or a rank that blames a rank already on the path (a cycle: they wait for each other);
3. raises the original error with that chain appended.

The store: any object with torch's ``set(key, str)``, ``check([key]) -> bool`` and ``get(key)``;
without one the error is raised unchanged. ``DirStore`` gives those three over a client that has
``key_value_set(key, value)`` and ``key_value_dir_get(prefix) -> [(key, value)]`` (jax.distributed's).
Keys live under ``tide/timeout/`` (or the face's ``prefix``: one per group when several groups
share the store) and are written once per rank (a rank fails stop after its first timeout).
``name(r)`` words a rank in the chain (tide_xla adds its process).
"""
from __future__ import annotations

import json
import re
import time
from typing import Any, Callable

import tide

_ROOT = (re.compile(r"root: rank (\d+)"),
         re.compile(r"rank (\d+) (?:never posted|is behind|is not blocked|runs in its own process|has started run)"))
_PREFIX = "tide/timeout/"


def root_of(message: str, rank: int) -> int | None:
    """The rank a timeout message's wait chain ends at, other than `rank` itself (None: none)."""
    for pattern in _ROOT:
        found = [int(m) for m in pattern.findall(message) if int(m) != rank]
        if found:
            return found[-1]
    return None


def _rank(r: int) -> str:
    return f"rank {r}"


def chain(rank: int, root: int | None, posted: Callable[[int], dict | None],
          name: Callable[[int], str] = _rank) -> str:
    """The survivors' chain from `rank`'s root: "rank 2 (waits for rank 3) -> rank 3 stopped
    (it posted no diagnosis)". `posted(r)` is rank r's post or None; `name(r)` words rank r."""
    if root is None:
        return ""
    path, r = [rank], root
    parts = []
    while True:
        if r in path:
            return " -> ".join(parts + [f"{name(r)} (a cycle: these ranks wait for each other)"])
        path.append(r)
        post = posted(r)
        if post is None:
            return " -> ".join(parts + [f"{name(r)} stopped (it posted no timeout diagnosis: dead, hung outside "
                                        "TIDE, or it never made this call)"])
        nxt = post.get("root")
        if nxt is None:
            return " -> ".join(parts + [f"{name(r)} (timed out too, its chain ends there: {post.get('head', '')})"])
        parts.append(f"{name(r)} (timed out, waits for rank {nxt})")
        r = nxt


def survivors_diagnosis(err: BaseException | str, rank: int, grace_s: float, store: Any,
                        prefix: str = _PREFIX, name: Callable[[int], str] = _rank) -> str:
    """Posts this rank's root, then returns the chain other survivors' posts give (see module doc)."""
    message = str(err)
    root = root_of(message, rank)
    if store is None:
        return ""
    try:
        store.set(f"{prefix}{rank}", json.dumps({"root": root, "head": message[:160]}))
    except (RuntimeError, ValueError):
        return ""
    deadline = time.monotonic() + grace_s
    seen: dict[int, dict] = {}

    def posted(r: int) -> dict | None:
        while r not in seen:
            try:
                if store.check([f"{prefix}{r}"]):
                    seen[r] = json.loads(store.get(f"{prefix}{r}"))
                    break
            except (RuntimeError, ValueError):
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return seen[r]

    return chain(rank, root, posted, name)


def appended(err: BaseException | str, rank: int, timeout_s: float, store: Any, **kw: Any) -> str:
    """"; survivors' diagnosis: <chain>" to append to a timeout's message ("" when there is none),
    waiting at most half the call's timeout (1 to 5 s) for the other survivors' posts; `kw`:
    survivors_diagnosis's prefix and name."""
    found = survivors_diagnosis(err, rank, min(max(1.0, 0.5 * timeout_s), 5.0), store, **kw)
    return f"; survivors' diagnosis: {found}" if found else ""


def diagnosed(fn: Callable[[], Any], rank: int, timeout_s: float, store: Callable[[], Any]) -> Any:
    """Runs `fn`; a tide.TimeoutError comes back with the survivors' chain appended. `store()`
    gives the key-value store (or None) only when a timeout happened."""
    try:
        return fn()
    except tide.TimeoutError as e:
        found = appended(e, rank, timeout_s, store())
        if not found:
            raise
        raise tide.TimeoutError(f"{e}{found}") from e


class DirStore:
    """torch's ``set`` / ``check`` / ``get`` over a key-value client with ``key_value_set(key,
    value)`` and ``key_value_dir_get(prefix) -> [(key, value)]`` (jax.distributed's coordination
    client); its errors are RuntimeErrors, which the diagnosis treats as a store that is gone."""

    def __init__(self, client: Any):
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def _find(self, key: str) -> str | None:
        return dict(self._client.key_value_dir_get(key.rsplit("/", 1)[0] + "/")).get(key)

    def check(self, keys: list[str]) -> bool:
        return all(self._find(k) is not None for k in keys)

    def get(self, key: str) -> str:
        value = self._find(key)
        if value is None:
            raise ValueError(f"DirStore: no key {key!r}")
        return value
