"""TIDE-AG schedule tables: Bruck rounds, stage slots, coalesced scatter descriptors."""
import math

import pytest

from tide import _core
from ag_helpers import make_plan


def test_bruck_rounds_cover_every_m_up_to_1024():
    for M in range(1, 1025):
        R, c = _core.ag_rounds_for(M)
        assert R == (math.ceil(math.log2(M)) if M > 1 else 0)
        assert sum(c) == M - 1, M
        assert all(c[d] == min(2 ** d, M - 2 ** d) for d in range(R))


@pytest.mark.parametrize("M", [2, 3, 5, 7, 8, 13, 64])
def test_peers_are_inverse_and_slots_land_once(M):
    R, c = _core.ag_rounds_for(M)
    for n in range(M):
        held = {0: n}  # slot -> node whose shard it holds
        for d in range(R):
            t = _core.ag_send_peer(n, d, M)
            assert _core.ag_recv_peer(t, d, M) == n
            src = _core.ag_recv_peer(n, d, M)
            # slots [2^d, 2^d + c_d) come from src's slots [0, c_d): node (src + i) mod M
            for i in range(c[d]):
                assert 2 ** d + i not in held
                held[2 ** d + i] = (src + i) % M
        assert held == {i: (n + i) % M for i in range(M)}


@pytest.mark.parametrize("M,L,cast", [(1, 4, False), (1, 2, True), (5, 2, False), (5, 2, True), (64, 1, False)])
def test_stage_sizes(M, L, cast):
    _, plan = make_plan(M, L, shard_dtype="float32" if cast else None)
    ag = _core.plan_ag(plan)
    S = plan.layout.S
    slots = (M if cast else M - 1) if M > 1 else (1 if cast else 0)
    assert ag.stage_slots == slots and ag.stage_bytes == slots * S


@pytest.mark.parametrize("M", [2, 3, 4, 5, 9, 16, 17, 33, 64, 100])
def test_scatter_runs_partition_slots_without_wrap(M):
    _, plan = make_plan(M, 1, shapes=[(4 * M, 2)])
    ag = _core.plan_ag(plan)
    for n in range(M):
        runs = _core.ag_scatter_runs(plan, n)
        slots = [s for (_, first, k) in runs for s in range(first, first + k)]
        assert sorted(slots) == list(range(1, M)), (M, n)
        for d, first, k in runs:
            assert 2 ** d <= first and first + k <= 2 ** d + ag.c[d]
            nodes = [(n + s) % M for s in range(first, first + k)]
            assert nodes == list(range(nodes[0], nodes[0] + k)), "a run crosses the mod-M wrap"
        last = [r for r in runs if r[0] == ag.rounds - 1]
        assert len({r[1] for r in last}) <= 4 + 1  # <= 4 groups, +1 for a wrap break


@pytest.mark.parametrize("M,L,P", [(2, 2, 3), (5, 2, 3), (16, 4, 2), (64, 1, 3), (64, 8, 1)])
def test_measured_descriptors_equal_formulas(M, L, P):
    shapes = [(3 * M * L + p, 2) for p in range(P)]
    _, plan = make_plan(M, L, shapes=shapes)
    ag = _core.plan_ag(plan)
    progs = _core.build_ag_programs(plan, with_expects=False)
    R = ag.rounds
    worst = 0
    for r in range(M * L):
        scat, puts, _ = progs.ag_stats(r)
        formula = _core.ag_scatter_descriptors(plan, r // L)
        assert scat == formula
        worst = max(worst, scat)
        assert puts == 2 * R  # head + tail per round
    assert worst == ag.descriptors_per_rank
    assert ag.flat_descriptors_per_rank == (M - 1) * P
    assert ag.local_push_descriptors == P
    # O(P log M): at most P per round, the last round's <= 4 groups, plus short runs and wraps.
    assert ag.descriptors_per_rank <= P * (2 * R + 8)
    if M >= 64:
        assert ag.descriptors_per_rank * 2 < ag.flat_descriptors_per_rank


def test_position_aware_ring_slots():
    assert _core.ag_ring_slot_bytes([10, 40, 30, 20, 5]) == [30, 40]
    assert _core.ag_ring_slot_bytes([7]) == [7, 0]
