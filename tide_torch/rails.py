"""The CPU rail: TIDE's two-sided rail groups over the framework's engine (torch.distributed
send/recv on a gloo process group), behind the core's rail interface (``tide/rail.h``).

A rank maps only its own node's arenas when the topology has more than one node; every byte to
another node travels as one of these transfers ([Note: two-sided rails] in ``tide/program.h``).
The core's CPU rank executor calls ``start``/``test`` from the thread that runs the call: a group
posts every send and receive at once (``isend``/``irecv``, the gloo engine progresses them
concurrently, as an NCCL group would), and ``test`` polls ([Note: gloo completion]). The k-th transfer between an ordered
pair of ranks carries tag k on both ends, so the engine meets them in the order the programs do.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch
import torch.distributed as dist


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of host memory at ``address`` (no copy)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class GlooRail:
    """Rail groups over ``group`` (a gloo process group of every rank, ranks as in the default
    group). ``start``/``test``/``abort``/``name``: the core's rail interface.

    [Note: gloo completion] A gloo send/recv reports completion only through ``wait()``, which
    blocks; the executor's streams must keep running meanwhile (a peer's receive may wait for
    this rank's other streams). So each group's works are waited for on a daemon thread
    (``wait`` releases the GIL) and ``test`` reads its result. A peer that never answers leaves
    that thread parked; the executor's deadline raises, and the process is expected to exit."""

    name = "gloo"

    def __init__(self, group: Any):
        self._group = group
        self._next = 0
        self._lock = threading.Lock()
        self._state: dict[int, list] = {}    # ticket -> [done, error]
        self._sent: dict[int, int] = {}      # peer -> transfers sent to it
        self._received: dict[int, int] = {}  # peer -> transfers received from it
        self._aborted: str | None = None

    def start(self, rank: int, sends: list, recvs: list) -> int:
        if self._aborted:
            raise RuntimeError(f"gloo rail: aborted ({self._aborted})")
        works = [self._post(True, *x) for x in sends] + [self._post(False, *x) for x in recvs]
        self._next += 1
        ticket = self._next
        state = [False, None]
        with self._lock:
            self._state[ticket] = state
        threading.Thread(target=self._wait, args=(works, state), daemon=True,
                         name=f"tide-gloo-rail-{ticket}").start()
        return ticket

    def _post(self, send: bool, peer: int, address: int, nbytes: int) -> tuple:
        """isend / irecv of one transfer, tagged with its ordinal for this (direction, peer)."""
        counts = self._sent if send else self._received
        tag = counts.get(peer, 0)
        counts[peer] = tag + 1
        buf = _bytes_at(address, nbytes)
        if send:
            return (dist.isend(buf, dst=peer, group=self._group, tag=tag), buf,
                    f"send of {nbytes} bytes to rank {peer}")
        return (dist.irecv(buf, src=peer, group=self._group, tag=tag), buf,
                f"receive of {nbytes} bytes from rank {peer}")

    def _wait(self, works: list, state: list) -> None:
        error = None
        for w, _buf, what in works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - named and re-raised by test()
                error = error or f"the {what} failed: {e}"
        with self._lock:
            state[1] = error
            state[0] = True

    def test(self, ticket: int) -> bool:
        with self._lock:
            done, error = self._state[ticket]
            if self._aborted:
                self._state.pop(ticket, None)
                raise RuntimeError(f"gloo rail: aborted ({self._aborted})")
            if not done:
                return False
            del self._state[ticket]
        if error:
            raise RuntimeError(f"gloo rail: {error}")
        return True

    def abort(self, why: str) -> None:
        """Fail-stop: pending and later groups fail ([Note: gloo completion])."""
        self._aborted = why or "aborted"
