"""The environment TIDE's Python reads, in one place: launch conventions and debug overrides.

Each is read when a face needs it (once per ``tide_torch.enable()``), so a value set between
two calls counts for the later one; configuration proper is arguments and option fields.
- ``LOCAL_WORLD_SIZE`` (launch convention: torchrun's ranks per node): the topology
  ``tide_torch.enable()`` assumes when it is given none;
- ``TIDE_TORCH_FABRIC`` (debug override): what ``enable(fabric="auto")`` resolves to.
The core reads its own, each once per executor or process (``tide/exec_options.h``:
``TIDE_DEBUG``, ``TIDE_EXEC_OPTIONS``; the multicast gate; ``TIDE_NCCL_LIBRARY``).
"""
from __future__ import annotations

import os

from tide.plan import Topology

LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
TORCH_FABRIC = "TIDE_TORCH_FABRIC"


def launcher_topology(world: int) -> Topology:
    """Nodes of LOCAL_WORLD_SIZE ranks, or one node of ``world`` where it is unset; a ValueError
    names the variable."""
    local = os.environ.get(LOCAL_WORLD_SIZE)
    try:
        gpn = int(local) if local else world
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is not an integer (the launcher's ranks per "
                         "node; or pass topology=tide.Topology(nodes, gpus_per_node))") from None
    if gpn <= 0 or world % gpn:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}")
    return Topology(nodes=world // gpn, gpus_per_node=gpn)


def torch_fabric() -> str:
    """TIDE_TORCH_FABRIC, stripped ('' when unset)."""
    return os.environ.get(TORCH_FABRIC, "").strip()
