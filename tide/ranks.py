"""Where ranks sit, and whether their records agree: framework-free facts the faces use.

- ``host_identity()``: the machine this process runs on. Ranks whose arenas are mapped by pointer
  (one topology node, or every rank with one-sided rails) must share it;
- ``node_host_problem(hosts, topo)``: why the ranks' hosts do not fit a topology;
- ``group_topology(ranks, topo)``: a sub-group's own M x L when its ranks are node-major on
  ``topo`` (a shard group of HSDP, or the dp sub-mesh of TP + FSDP);
- ``verdict(records, compared)``: the problems in one record per rank (each rank's local error,
  or a differing field), the same on every rank that holds the same records, so every rank
  reaches the same decision from one exchange and nobody waits on another;
- ``await_keys(dir_get, key, wanted, timeout_ms, late)``: every rank's value under ``key/<n>``
  in a key-value store (jax.distributed's), polled until all are there or the deadline names
  who is late.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Callable, Iterable, Sequence

from tide.plan import Topology


def host_identity() -> str:
    """Hostname and boot id. Emulated hosts (one ``NCCL_HOSTID`` per process on one machine) are
    still one machine here."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def node_host_problem(hosts: Sequence[str], topo: Topology) -> str | None:
    """Why the ranks' hosts do not fit ``topo`` (a node's ranks on two hosts), or None."""
    L = topo.gpus_per_node
    for n in range(topo.nodes):
        ranks = range(n * L, (n + 1) * L)
        if len({hosts[r] for r in ranks}) > 1:
            a = ranks[0]
            b = next(r for r in ranks if hosts[r] != hosts[a])
            return (f"ranks {a} and {b} of topology node {n} ({topo}) are on hosts {hosts[a]!r} and "
                    f"{hosts[b]!r}: a node's ranks must share a host (check LOCAL_WORLD_SIZE or the "
                    "topology)")
    return None


def group_topology(ranks: Sequence[int], topo: Topology) -> Topology | None:
    """The group's own M x L, when its ranks are node-major on ``topo``; else None."""
    L = topo.gpus_per_node
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // L, []).append(r)
    per_node = {len(v) for v in nodes.values()}
    if len(per_node) != 1:
        return None
    if [r for n in sorted(nodes) for r in sorted(nodes[n])] != list(ranks):
        return None
    return Topology(nodes=len(nodes), gpus_per_node=per_node.pop())


def verdict(records: Sequence[dict[str, Any]], compared: Sequence[str],
            groups: str = "groups") -> list[str]:
    """Problems found (empty: all ranks agree). Each record has ``rank``, ``error`` (None or the
    rank's local failure), the ``compared`` fields, and ``groups``: [(name, status)] in order
    (``groups`` names them in messages)."""
    errors = [(r["rank"], r["error"]) for r in records if r.get("error")]
    if errors:
        return [f"rank {rank} failed: {err}" for rank, err in errors]
    problems = []
    ref = records[0]
    for rec in records[1:]:
        for key in compared:
            if rec[key] != ref[key]:
                problems.append(f"rank {rec['rank']} has {key} {rec[key]} but rank "
                                f"{ref['rank']} has {ref[key]}")
        a, b = ref["groups"], rec["groups"]
        if len(a) != len(b):
            problems.append(f"rank {rec['rank']} has {len(b)} {groups} but rank "
                            f"{ref['rank']} has {len(a)}")
            continue
        for i, ((fa, sa), (fb, sb)) in enumerate(zip(a, b)):
            if (fa, sa) != (fb, sb):
                problems.append(f"group {i}: rank {ref['rank']} has {fa} {sa}, rank "
                                f"{rec['rank']} has {fb} {sb}")
    return problems


def await_keys(dir_get: Callable[[str], Iterable[tuple[str, str]]], key: str, wanted: Iterable[int],
               timeout_ms: int, late: Callable[[list[int]], BaseException]) -> dict[int, str]:
    """The values under ``key/<n>`` for every n in ``wanted`` (``dir_get(prefix)`` lists a
    store's entries under a prefix), polled until all are there; past ``timeout_ms`` raises
    ``late(missing)`` (an error naming who did not publish)."""
    wanted = list(wanted)
    deadline = time.monotonic() + timeout_ms / 1000.0
    pause = 0.001
    while True:
        got = {}
        for k, v in dir_get(f"{key}/"):
            tail = k.rsplit("/", 1)[-1]
            if tail.isdigit():
                got[int(tail)] = v
        missing = sorted(n for n in wanted if n not in got)
        if not missing:
            return got
        if time.monotonic() > deadline:
            raise late(missing)
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
