"""RS validator (Prop. 4.1, App. D): per-wave inbox bitmask, collisions, stale blocks, regression."""
import time

import pytest
from hypothesis import given, settings, strategies as st

import tide
from tide import _core


def colliding(M, L, w_wave):
    """Closed form of App. D: only the last wave can collide, when it holds the own node (c = M,
    residue 0) and a remote contributor that is a multiple of L."""
    W = -(-M // w_wave)
    first = (W - 1) * w_wave + 1
    return any(c % L == 0 for c in range(first, M))


def test_validate_all_reproduces_the_paper():
    t0 = time.perf_counter()
    r = _core.validate_all(8, 1024)
    secs = time.perf_counter() - t0
    print(f"validate_all(8, 1024): {r['accepted']} accepted, {r['rejected']} rejected, "
          f"{len(r['accepted_pairs'])}/{len(r['rejected_pairs'])} (M, W_wave) pairs, "
          f"n_part ok {r['n_part_ok']} over {r['n_part_checked']} checks, {secs:.2f} s")
    assert r["accepted"] == 458_304
    assert r["rejected"] == 65_472
    assert len(r["accepted_pairs"]) == 7_161 and len(r["rejected_pairs"]) == 1_023
    assert r["n_part_ok"], r["n_part_failure"]
    assert r["n_part_checked"] == 3 * 458_304
    rejected = set(map(tuple, r["rejected_pairs"]))
    expected = {(M, w) for M in range(2, 1025) for w in range(1, 9) if colliding(M, 8, w)}
    assert rejected == expected
    assert (9, 3) in rejected
    assert 9 in r["rejected_by_w_wave"][3] and "458304 accepted and 65472 rejected" in r["summary"]
    # Prop. 4.1: widths dividing L never collide.
    assert not any(w in (1, 2, 4, 8) for _, w in rejected)
    assert secs < 30


@pytest.mark.parametrize("L", [1, 2, 4, 7])
def test_validate_all_other_node_sizes(L):
    r = _core.validate_all(L, 64)
    pairs = 63 * L
    rej = {(M, w) for M in range(2, 65) for w in range(1, L + 1) if colliding(M, L, w)}
    assert set(map(tuple, r["rejected_pairs"])) == rej
    assert r["rejected"] == 64 * len(rej) and r["accepted"] == 64 * (pairs - len(rej))
    assert r["n_part_ok"]


def test_app_d_example_m9_l8_w3_is_rejected_with_reason():
    why = _core.check_rs_shape(9, 8, 3)
    assert "c=8" in why and "c=9" in why and "wave 2" in why and "W_wave=3" in why
    with pytest.raises(tide.PlanError, match=r"c=8 and c=9"):
        tide.plan(tide.GroupSignature(shapes=[(4096, 16)]), tide.Topology(9, 8), w_wave=3)
    # The same width is fine where the final wave holds no multiple of L besides the own node.
    assert _core.check_rs_shape(8, 8, 3) == ""
    assert tide.plan(tide.GroupSignature(shapes=[(4096, 16)]), tide.Topology(8, 8), w_wave=3)


@settings(max_examples=150, deadline=None)
@given(M=st.integers(2, 200), L=st.sampled_from([1, 2, 4, 8]), wi=st.integers(0, 3),  # M = 1: no Level 2
       n_part=st.integers(1, 4), k=st.integers(1, 8), mode=st.sampled_from(["in_place", "slot_reuse"]))
def test_latin_square_collision_freedom(M, L, wi, n_part, k, mode):
    """Prop. 4.1 for every divisor width: for each wave and sub-slice s the contributors land on
    distinct destination GPUs j(s, c) = (s - c mod M) mod L, checked from the formula and from
    the planner's bitmasks."""
    divisors = [d for d in (1, 2, 4, 8) if d <= L and L % d == 0]
    w_wave = divisors[wi % len(divisors)]
    assert _core.check_rs_shape(M, L, w_wave, n_part, k, mode) == ""
    rows = 4 * M * L
    p = tide.plan(tide.GroupSignature(shapes=[(rows, 96)]), tide.Topology(M, L), mode,
                  w_wave=w_wave, k=k, n_part=n_part)
    waves = p.rs_schedule.waves_info
    assert len(waves) == n_part * -(-M // w_wave)
    for wv in waves:
        cs = range(wv["c_begin"], wv["c_end"])
        for s in range(L):
            gpus = [((s - c % M) % L + L) % L for c in cs]
            assert len(set(gpus)) == len(gpus)
            assert sorted(gpus) == sorted(j for j in range(L) if wv["write_mask"][j] >> s & 1)
        # each contributor fills exactly one block on every GPU
        assert all(bin(m).count("1") == len(cs) for m in wv["write_mask"])


@settings(max_examples=60, deadline=None)
@given(M=st.integers(2, 40), L=st.sampled_from([2, 4, 8]), w_wave=st.integers(1, 8),  # M = 1: no Level 2
       n_part=st.integers(1, 4))
def test_stale_block_zeroing_sets(M, L, w_wave, n_part):
    """Replaying the planner's zero masks over three calls, each starting from unknown inbox
    contents: before every landing exactly the current wave's blocks may be non-zero on every
    GPU (own simulation, independent of C++)."""
    w_wave = min(w_wave, L)
    if colliding(M, L, w_wave):
        return
    p = tide.plan(tide.GroupSignature(shapes=[(8 * M * L, 48)]), tide.Topology(M, L),
                  w_wave=w_wave, n_part=n_part)
    waves = p.rs_schedule.waves_info
    assert p.rs_schedule.n_par == (1 if -(-M // w_wave) == 1 else 2)
    for _call in range(3):
        dirty = {(g, j): (1 << L) - 1 for g in range(2) for j in range(L)}
        for g, wv in enumerate(waves):
            assert wv["gen"] == g % p.rs_schedule.n_par
            for j in range(L):
                assert wv["zero_mask"][j] & wv["write_mask"][j] == 0
                d = dirty[wv["gen"], j] & ~wv["zero_mask"][j]
                assert d & ~wv["write_mask"][j] == 0
                dirty[wv["gen"], j] = d | wv["write_mask"][j]
    assert sum(w["own"] for w in waves) == n_part and all(w["own"] for w in waves[-1:])


@pytest.mark.parametrize("fault,needle", [
    ("skip_zeroing", "stale-block zeroing missing"),
    ("single_generation", "generation"),
    ("zero_written_block", "that this wave writes"),
])
def test_validator_catches_corrupt_schedules(fault, needle):
    # M=10, L=8, W_wave=4: waves {1-4} {5-8} {9,10}; waves 0 and 2 share generation 0.
    assert _core.check_rs_shape(10, 8, 4) == ""
    why = _core.check_rs_shape(10, 8, 4, fault=fault)
    assert needle in why, why


def test_zero_sets_example():
    p = tide.plan(tide.GroupSignature(shapes=[(4096, 4)]), tide.Topology(10, 8), w_wave=4, n_part=1)
    w0, w1, w2 = p.rs_schedule.waves_info
    assert (w0["gen"], w1["gen"], w2["gen"]) == (0, 1, 0)
    for j in range(8):
        assert w2["zero_mask"][j] == w0["write_mask"][j] & ~w2["write_mask"][j]
        # first use of a generation in a call: everything the wave does not write
        assert w0["zero_mask"][j] == 0xFF & ~w0["write_mask"][j]
        assert w1["zero_mask"][j] == 0xFF & ~w1["write_mask"][j]
        assert bin(w0["write_mask"][j]).count("1") == 4 and bin(w2["write_mask"][j]).count("1") == 2
    # full waves zero nothing
    full = tide.plan(tide.GroupSignature(shapes=[(4096, 4)]), tide.Topology(20, 8), n_part=1).rs_schedule.waves_info
    assert full[0]["zero_mask"] == [0] * 8 and full[1]["zero_mask"] == [0] * 8
