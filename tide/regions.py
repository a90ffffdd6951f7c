"""One rank's arena as named regions, in the order given, each aligned to ``ALIGN`` bytes: the
byte layout a face's arena uses (tide_torch/arena.py lays out its shared-memory segment or CUDA
allocation this way; placement.py sizes the regions from the groups' plans).
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 256  # bytes; every region and every group inside a region starts on this boundary


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    nbytes: int


def layout(sizes: dict[str, int]) -> dict[str, Region]:
    """The regions of ``sizes`` (name -> bytes), back to back, each rounded up to ``ALIGN``."""
    regions, off = {}, 0
    for name, nbytes in sizes.items():
        nbytes = align_up(int(nbytes))
        regions[name] = Region(name, off, nbytes)
        off += nbytes
    return regions


def arena_nbytes(sizes: dict[str, int]) -> int:
    """Bytes of an arena with these region sizes (each region aligned; at least ``ALIGN``)."""
    return max(sum(align_up(int(n)) for n in sizes.values()), ALIGN)
