"""test_torch_parity's checks (a), (b), (d) on world 4 as 4 nodes x 1 GPU: the L_sub = 1 lane
(no node-local peers; every transfer is a rail transfer)."""
from __future__ import annotations

from _torch_dist import spawn
from test_torch_parity import parity


def test_parity_4x1():
    spawn(parity, 4, 1)
