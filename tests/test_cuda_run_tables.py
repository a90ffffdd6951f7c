"""REDUCE run tables (host side of the CUDA executor's SUM/LAND) against the program's terms.

Runs wherever tide._core is built with CUDA (no GPU needed): for RS programs over a grid of
plans, every element of every SUM/LAND destination must read, for each term in operand order,
exactly the source byte the CPU executor reads (or nothing where the term has no piece).
"""
import re

import pytest

import tide
from tide import _core

if not getattr(_core, "built_with_cuda", False):
    pytest.skip("tide._core built without CUDA", allow_module_level=True)

KIND = dict(_core.buf_kinds)
ARENA_KINDS = {k for n, k in KIND.items() if n not in ("shard", "landing", "grad", "out")}
SHAPES = [(37, 16), (5,), (64, 3, 8), (9, 40), (3, 7), (128, 24)]


def _expected(pieces, n, n_terms, ps, rank):
    """Per term: element -> (slot, byte offset) as the CPU executor addresses it."""
    term_ids = sorted({p[0] for p in pieces})
    if not term_ids:  # no operand: one absent term
        assert n_terms == 1
        return [dict()]
    assert len(term_ids) == n_terms
    want = [dict() for _ in term_ids]
    for term, dst, elems, kind, srank, index, off, size in pieces:
        t = term_ids.index(term)
        if kind == KIND["grad"]:
            assert srank == rank
            slot, base = index, off
        elif kind == KIND["out"]:
            slot, base = 256, off
        else:
            assert kind in ARENA_KINDS
            region_off, _ = _core.cuda_arena_region(ps, kind)
            slot, base = 257 + srank, region_off + off
        for i in range(elems):
            assert dst + i not in want[t], "overlapping pieces in one term"
            want[t][dst + i] = (slot, base + i * size)
    return want


@pytest.mark.parametrize("M,L,expert", [(1, 2, False), (2, 2, False), (3, 2, False), (2, 4, False),
                                        (4, 2, False), (9, 2, False), (2, 8, False), (3, 1, True),
                                        (5, 1, True)])
@pytest.mark.parametrize("bank,accumulate", [(0, True), (1, False)])
def test_run_tables_address_what_the_cpu_reads(M, L, expert, bank, accumulate):
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), tide.Topology(M, L))
    ps = _core.build_rs_programs(plan, bank=bank, alpha=0.5, accumulate=accumulate, expert_lane=expert)
    checked = 0
    for rank in range(M * L):
        for line in ps.describe(rank):
            m = re.match(r"(\d+) (SUM|LAND) ", line)
            if not m:
                continue
            op = int(m.group(1))
            n, n_terms, mask, runs, pieces = _core.cuda_run_table(ps, rank, op)
            sizes = {}
            for term, *_rest, size in pieces:
                sizes.setdefault(term, size)
            for t, term in enumerate(sorted(sizes)):
                assert bool(mask >> t & 1) == (sizes[term] == 4)
            want = _expected(pieces, n, n_terms, ps, rank)
            pos = 0
            for dst_off, length, slots, offs in runs:
                assert dst_off == pos and length > 0
                for t in range(n_terms):
                    size = sizes[sorted(sizes)[t]] if sizes else 2
                    for k in (dst_off, dst_off + length - 1, dst_off + length // 2):
                        if slots[t] < 0:
                            assert k not in want[t], (rank, op, t, k)
                        else:
                            assert want[t].get(k) == (slots[t], offs[t] + (k - dst_off) * size), (rank, op, t, k)
                pos += length
            assert pos == n
            checked += 1
    assert checked > 0
