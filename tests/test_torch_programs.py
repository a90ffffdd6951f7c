"""tide_torch driving TIDE's own all-gather and reduce-scatter programs (tide.VirtualCluster, the
CPU executor) inside FSDP2 training: same checks as test_torch_parity.py — bitwise equal to stock
FSDP2 on exact data, within fp32 tolerance on random data, landings at planned addresses — with
TIDE's landing layout, fp32 summation order and alpha folding producing the bytes.
"""
from __future__ import annotations

from _torch_dist import spawn
from test_torch_parity import parity

CASES = ((True, "in_place"), (False, "slot_reuse"))


def test_programs_2x2():
    spawn(parity, 2, 2, "virtual-cluster", CASES)


def test_programs_4x1():
    spawn(parity, 4, 1, "virtual-cluster", CASES)
