"""Sizing solver (Eqs. 13-14, App. G) and Eq. 1."""
import math

import pytest
from hypothesis import given, settings, strategies as st

import tide

GROUP_32MIB = [(65536, 8192)]  # 8 x 8: R = 1024 rows of 8192 -> 32 MiB fp32 output per rank


def _plan(shapes, M, L, **kw):
    cal = kw.pop("calibration", None)
    grad = kw.pop("grad_dtype", "bfloat16")
    return tide.plan(tide.GroupSignature(shapes=shapes, grad_dtype=grad), tide.Topology(M, L),
                     calibration=cal, **kw)


def _rounds_by_simulation(M, k, W):
    # Contributors 1..M in increasing order, W per wave; M (own node) sends nothing; each wave's
    # remote sends are issued k per round.
    rounds = 0
    contributors = list(range(1, M + 1))
    for i in range(0, M, W):
        remote = [c for c in contributors[i:i + W] if c != M]
        while remote:
            remote = remote[k:]
            rounds += 1
    return rounds


def test_eight_nodes_selects_k4_and_four_sum_ctas():
    p = _plan(GROUP_32MIB, 8, 8)
    assert p.layout.S_fp32 == 32 << 20
    s = p.solver
    assert (s["k"], s["sum_ctas"]) == (4, 4)  # the paper's outcome on its eight-node system
    # C_mc = min(floor(90/21) = 4, ceil(47.5 / (0.05 * 7 * 21)) = 7) = 4
    assert s["land_ctas"] == 4
    assert s["t_nic_s"] == pytest.approx(7 * (32 << 20) / 47.5e9)
    assert s["rounds"] == 2 and not (s["k_given"] or s["sum_ctas_given"] or s["land_ctas_given"])
    assert p.options["k"] == 4 and p.options["sum_ctas"] == 4 and p.rs["k"] == 4


def test_sum_ctas_eq13():
    for L, grad, want in ((8, "bfloat16", 4), (8, "float32", 7), (4, "bfloat16", 3)):
        b = 4 if grad == "float32" else 2
        assert math.ceil(1.5 * (L * b / 4 + 1) * 47.5 / 99) == want
        assert _plan(GROUP_32MIB, 8, L, grad_dtype=grad).solver["sum_ctas"] == want


def test_land_ctas_eq14_tail_bound():
    # M = 64, n_part = 1: 47.5/(0.05*63*21) = 0.72 -> 1 landing CTA; M = 2: 45.2 -> capped at 4.
    assert _plan(GROUP_32MIB, 64, 8).solver["land_ctas"] == 1
    assert _plan(GROUP_32MIB, 2, 8).solver["land_ctas"] == 4
    # A slower landing CTA raises the need: M = 8, BW_land = 5 GB/s -> min(18, ceil(27.1)) = 18.
    s = _plan(GROUP_32MIB, 8, 8, calibration={"bw_land": 5e9}, n_part=1).solver
    assert s["land_ctas"] == 18


def test_k_doubling_rule():
    assert _plan(GROUP_32MIB, 2, 8).solver["k"] == 1  # min(2, M-1)
    assert _plan(GROUP_32MIB, 3, 8).solver["k"] == 2  # doubling would not cut rounds (1 -> 1)
    # Cheap rounds: overhead below 10% of t_NIC, so k stays at its start value.
    assert _plan(GROUP_32MIB, 8, 8, calibration={"t_rnd": 1e-9}).solver["k"] == 2
    # k_max caps doubling.
    assert _plan(GROUP_32MIB, 64, 8, calibration={"k_max": 2}).solver["k"] == 2
    assert _plan(GROUP_32MIB, 64, 8, calibration={"k_max": 8}).solver["k"] == 8
    assert _plan(GROUP_32MIB, 1, 8).solver["rounds"] == 0


def test_explicit_options_override_solver():
    p = _plan(GROUP_32MIB, 8, 8, k=3, sum_ctas=16, land_ctas=2)
    s = p.solver
    assert (s["k"], s["sum_ctas"], s["land_ctas"]) == (3, 16, 2)
    assert s["k_given"] and s["sum_ctas_given"] and s["land_ctas_given"]
    assert s["rounds"] == 3  # ceil(7 / 3)
    assert (p.options["k"], p.options["sum_ctas"], p.options["land_ctas"]) == (3, 16, 2)


def test_n_rounds_by_hand():
    assert tide.n_rounds(8, 2, 8) == 4 and tide.n_rounds(8, 4, 8) == 2
    assert tide.n_rounds(64, 4, 8) == 16 and tide.n_rounds(64, 2, 8) == 32
    assert tide.n_rounds(9, 4, 8) == 2   # second wave holds only the own node
    assert tide.n_rounds(10, 4, 8) == 3  # second wave: contributor 9 remote, 10 own


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1024), st.integers(1, 8), st.integers(1, 8))
def test_n_rounds_matches_simulation(M, k, W):
    assert tide.n_rounds(M, k, W) == _rounds_by_simulation(M, k, W)
    assert tide.n_rounds(M, 1, W) == M - 1


def test_recoverable_overhead_fraction():
    assert tide.recoverable_overhead_fraction(30.5e9, 3.3e9, 16384) == pytest.approx(
        30.5e9 / (3.3e9 * 16384))
    # Sparse MoE (Psi_total >> Psi_active) recovers more than dense at the same token budget.
    assert (tide.recoverable_overhead_fraction(30.5e9, 3.3e9, 16384)
            > tide.recoverable_overhead_fraction(70e9, 70e9, 16384))
    with pytest.raises(tide.PlanError, match="psi_active"):
        tide.recoverable_overhead_fraction(1.0, 0.0, 1.0)
    with pytest.raises(tide.PlanError, match="calibration: unknown field 'bw_x'"):
        _plan(GROUP_32MIB, 8, 8, calibration={"bw_x": 1.0})


def test_land_ctas_one_node_is_the_fabric_ceiling():
    """M = 1 has no network phase: Eq. 14's need grows without bound as t_NIC -> 0, so C_mc is
    the fabric ceiling floor(BW_cap / BW_land) (4 with the default calibration), not 1."""
    import math
    cal = tide._core.calibration_defaults()
    cap = math.floor(cal["bw_cap"] / cal["bw_land"])
    for L in (1, 4, 8):
        assert _plan(GROUP_32MIB, 1, L).solver["land_ctas"] == cap
    assert _plan(GROUP_32MIB, 1, 8, calibration={"bw_cap": 210e9}).solver["land_ctas"] == 10
