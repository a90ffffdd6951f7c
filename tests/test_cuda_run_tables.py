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
            region_off, _ = _core.cuda.arena_region(ps, kind)
            slot, base = 257 + srank, region_off + off
        for i in range(elems):
            assert dst + i not in want[t], "overlapping pieces in one term"
            want[t][dst + i] = (slot, base + i * size)
    return want


def _reduce_ops(ps, world):
    """(rank, op index, "SUM" | "LAND") of every reduce op of a program set, from its listing."""
    for rank in range(world):
        for line in ps.describe(rank):
            m = re.match(r"(\d+) (SUM|LAND) ", line)
            if m:
                yield rank, int(m.group(1)), m.group(2)


@pytest.mark.parametrize("M,L,expert", [(1, 2, False), (2, 2, False), (3, 2, False), (2, 4, False),
                                        (4, 2, False), (9, 2, False), (2, 8, False), (3, 1, True),
                                        (5, 1, True)])
@pytest.mark.parametrize("bank,accumulate", [(0, True), (1, False)])
def test_run_tables_address_what_the_cpu_reads(M, L, expert, bank, accumulate):
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES), tide.Topology(M, L))
    ps = _core.build_rs_programs(plan, bank=bank, alpha=0.5, accumulate=accumulate, expert_lane=expert)
    checked = level1_ops = 0
    for rank, op, kind in _reduce_ops(ps, M * L):
        n, n_terms, mask, runs, pieces, level1, segments, slot_of = _core.testing.run_table(ps, rank, op)
        if kind == "SUM":
            assert (level1 is not None) == _level1_shape(n_terms, mask, runs), (rank, op)
            if level1 is not None:
                _check_level1(level1, n_terms, runs)
                _check_segments(segments, n, n_terms, runs)
                level1_ops += 1
        else:
            assert level1 is None and segments is None
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
        # The table's slot map names what each slot is, as the pieces say (slots above).
        used = {sl for _, _, slots, _ in runs for sl in slots if sl >= 0}
        assert set(slot_of) == used, (rank, op)
        for sl, what in slot_of.items():
            assert what == (("grad", sl) if sl < 256 else ("out",) if sl == 256 else ("arena", sl - 257))
        checked += 1
    assert checked > 0
    # Level-1 node partials with staged bytes at every element take kernels.cu's SUM (at M = 1,
    # L = 2 these tiny shapes leave staging rows uncovered: REDUCE); the expert lane has no
    # staging.
    if L >= 2 and not expert and M > 1:
        assert level1_ops > 0, "no SUM took the Level-1 path"
    if expert or L == 1:
        assert level1_ops == 0


def _level1_shape(n_terms, mask, runs):
    """exec/cuda/issue.h [Note: Level-1 SUM on kernels.cu's SUM], from the runs: all bf16, the first
    n_terms - 1 terms present everywhere, each from one slot laid out like dst, the last term a
    gradient piece (slot < 256, element-aligned) or absent."""
    if mask or not 2 <= n_terms <= 8:
        return False
    _, _, slots0, offs0 = runs[0]
    base = [(slots0[j], offs0[j] - 2 * runs[0][0]) for j in range(n_terms - 1)]
    for dst_off, _length, slots, offs in runs:
        if any(slots[j] < 0 or (slots[j], offs[j] - 2 * dst_off) != base[j] for j in range(n_terms - 1)):
            return False
        if slots[-1] >= 256 or (slots[-1] >= 0 and offs[-1] % 2):
            return False
    return True


def _check_level1(level1, n_terms, runs):
    """The reported slices are the runs' staged terms: slice j at (slot, base + 2 k) for dst
    element k."""
    assert len(level1) == n_terms - 1
    for dst_off, _length, slots, offs in runs:
        for j, (slot, base) in enumerate(level1):
            assert slots[j] == slot and offs[j] == base + 2 * dst_off


def _check_segments(segments, n, n_terms, runs):
    """SUM's segment table tiles [0, n) in order and carries each run's own term (the last
    column): param = its gradient slot, src_off its element offset; absent -> param < 0."""
    assert [s[0] for s in segments] == [r[0] for r in runs] and sum(s[1] for s in segments) == n
    for (dst_off, length, src_off, param), (d0, ln, slots, offs) in zip(segments, runs):
        assert (dst_off, length) == (d0, ln)
        own = n_terms - 1
        if slots[own] < 0:
            assert param < 0
        else:
            assert (param, 2 * src_off) == (slots[own], offs[own])


@pytest.mark.parametrize("M,L", [(1, 8), (2, 8), (1, 4)])
def test_level1_sums_of_the_70b_group_take_the_sum_kernel(M, L):
    """The bench's group: every Level-1 SUM of rank 0 runs kernels.cu's SUM in the executors."""
    from tide import models
    plan = tide.plan(models.signature("llama3.1-70b", "block"), tide.Topology(M, L))
    ps = _core.build_rs_programs(plan, bank=0, alpha=0.5, accumulate=False, expert_lane=False)
    sums = [int(m.group(1)) for line in ps.describe(0) if (m := re.match(r"(\d+) SUM ", line))]
    rs = plan.rs_schedule
    per_unit = 1 if rs.direct or rs.n_chunks == 1 else L  # chunked Level 2: one SUM per block row
    assert len(sums) == rs.n_part * M * rs.n_chunks * per_unit
    for op in sums:
        level1 = _core.testing.run_table(ps, 0, op)[5]
        assert level1 is not None and len(level1) == L - 1


@pytest.mark.parametrize("M,L", [(2, 4), (3, 2), (1, 4)])
def test_fp16_gradients_mark_their_terms_and_take_the_fp16_sum(M, L):
    """fp16 gradients: every term that reads a gradient or a staged slice is in the fp16 mask
    (none in both masks), and a Level-1 SUM runs kernels.cu's SUM in its fp16 form."""
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, grad_dtype="float16"), tide.Topology(M, L))
    ps = _core.build_rs_programs(plan, bank=0, alpha=0.5, accumulate=False, expert_lane=False)
    level1_ops = 0
    for rank, op, kind in _reduce_ops(ps, M * L):
        _, n_terms, f32, _, pieces, level1, _, _ = _core.testing.run_table(ps, rank, op)
        f16, level1_fp16 = _core.testing.run_table_fp16(ps, rank, op)
        sizes = {}
        for term, *_rest, size in pieces:
            sizes.setdefault(term, size)
        for t, term in enumerate(sorted(sizes)):
            assert bool(f16 >> t & 1) == (sizes[term] == 2) and bool(f32 >> t & 1) == (sizes[term] == 4)
        if level1 is not None:
            assert level1_fp16 and f32 == 0 and f16 == (1 << n_terms) - 1
            level1_ops += 1
    if L >= 2 and M > 1:
        assert level1_ops > 0
