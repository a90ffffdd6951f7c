"""POSIX shared-memory segments for faces whose ranks are processes: tide_torch's CPU arena and
tide_xla across jax.distributed processes. One way to create (mode 0600, unique name, sized and
zero-filled), map, unlink and measure /dev/shm's room. The core's own CpuArena (the virtual
cluster) has no named segment: its rank processes inherit an anonymous shared mapping
(exec/cpu/arena.cc [Note: shared-memory lifetime]).

A segment larger than /dev/shm's free space is created and mapped without complaint and dies
with SIGBUS when touched, so callers check `free_bytes()` first and name what makes it large.
"""
from __future__ import annotations

import mmap
import os
import uuid

import _posixshmem


def free_bytes() -> int | None:
    """The bytes free in /dev/shm, or None where there is none to measure (the mapping decides)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def shortfall(nbytes: int) -> str:
    """'' when /dev/shm has room for `nbytes` more, else how much is free (a segment past the free
    space dies with SIGBUS when touched: callers refuse it and name what makes it large)."""
    free = free_bytes()
    if nbytes <= 0 or free is None or nbytes <= free:
        return ""
    return f"need {nbytes} bytes of /dev/shm, {free} free"


def create(prefix: str, nbytes: int, *, map_it: bool = False) -> tuple[str, mmap.mmap | None]:
    """A new segment '/<prefix>_<pid>_<random>' of `nbytes` (zero-filled); with map_it, also its
    mapping. The name is unlinked again if sizing or mapping fails."""
    name = f"/{prefix}_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, nbytes)
        return name, (mmap.mmap(fd, nbytes) if map_it else None)
    except BaseException:
        _posixshmem.shm_unlink(name)
        raise
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Removes the name (mappings stay valid); a name already gone is fine."""
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass
