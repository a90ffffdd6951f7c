"""Memory model (Section 5.4, Eqs. 10-12) and arena layout."""
import pytest
from hypothesis import given, settings, strategies as st

import tide

VOCAB = [(128256, 8192)]  # Llama-3.1-70B vocabulary layer
REGIONS = ["ring0", "ring1", "resident", "stage", "staging", "outbox", "inbox", "spare",
           "counters"]


def _plan(shapes, M, L, mode="in_place", **kw):
    dt = {k: kw.pop(k) for k in ("ag_dtype", "grad_dtype", "shard_dtype") if k in kw}
    return tide.plan(tide.GroupSignature(shapes=shapes, **dt), tide.Topology(M, L), mode=mode, **kw)


# The paper's closed forms (Eqs. 10-12) are for one pass and whole-sub-slice staging.
WHOLE = dict(n_part=1, chunk_bytes=1 << 40)


def test_paper_bounds_at_64_nodes():
    # Paper, Section 5.4: L = 8, M = 64, n_par = 2, k = 4 -> 0.594 NS and 0.164 NS; totals
    # <= 3.72 NS (In-Place) and 2.29 NS (Slot-Reuse) against FSDP2's 4 NS.
    M, n_par, k = 64, 2, 4
    in_place = (2 * M + 8 * n_par + 8) / (4 * M)     # Eq. 11 in S_fp32 = NS/(4M) units
    slot = (4 * k + 8 * n_par + 10) / (4 * M)         # Eq. 12
    assert round(in_place, 3) == 0.594 and round(slot, 3) == 0.164
    for mode, bound, total in (("in_place", in_place, 3.72), ("slot_reuse", slot, 2.29)):
        p = _plan(VOCAB, M, 8, mode, k=k, **WHOLE)
        assert p.rs["n_par"] == n_par
        m = p.memory()
        assert m["area_inplace_bound_ns"] == pytest.approx(in_place, abs=1e-12)
        assert m["area_slot_bound_ns"] == pytest.approx(slot, abs=1e-12)
        assert m["area_inplace_bound_bytes"] == pytest.approx(in_place * m["NS_bytes"], abs=1)
        assert m["area_rs_ns"] == pytest.approx(bound, abs=0.005)
        assert m["area_rs_ns"] <= bound + 1e-9
        grads = 1.0 if mode == "in_place" else 0.0
        assert m["live_tide_bound_ns"] == pytest.approx(2 + 1 / 8 + bound + grads, abs=1e-12)
        assert m["live_tide_bound_ns"] <= total
        assert m["live_tide_ns"] <= total
        assert m["live_fsdp2_ns"] == pytest.approx(4.0)


def test_area_rs_by_hand_for_the_vocab_layer():
    # N = 512: R = ceil(128256/512) = 251, E = 251*8192, E_sub = E/8 (a multiple of 4),
    # block = 4*8*E_sub bytes = S_fp32, staging slot = (L-1)*L*E_sub*2 bytes.
    E = 251 * 8192
    block = 4 * E
    slot = 7 * 8 * (E // 8) * 2
    NS = 512 * 2 * E
    for mode, n_out in (("in_place", 63), ("slot_reuse", 8)):
        m = _plan(VOCAB, 64, 8, mode, k=4, **WHOLE).memory()
        assert m["staging_slot_bytes"] == slot
        assert m["staging_bytes"] == 2 * slot
        assert m["inbox_bytes"] == 2 * 8 * block
        assert m["outbox_bytes"] == 2 * n_out * block
        assert m["spare_bytes"] == 2 * block
        assert m["area_rs_bytes"] == 2 * slot + (16 + 2 * n_out + 2) * block
        assert m["NS_bytes"] == NS
        assert m["ring_bytes"] == 2 * NS and m["stage_bytes"] == 63 * 2 * E
        assert m["prev_grad_bytes"] == (NS if mode == "in_place" else 0)


def test_in_place_tends_to_half_ns_slot_reuse_decays():
    big = [(1 << 16, 256)]
    ip = [_plan(big, M, 8, k=4, **WHOLE).memory()["area_inplace_bound_ns"] for M in (16, 64, 256, 1024)]
    sr = [_plan(big, M, 8, k=4, **WHOLE).memory()["area_slot_bound_ns"] for M in (16, 64, 256, 1024)]
    assert ip == sorted(ip, reverse=True) and 0.5 < ip[-1] < 0.51
    assert sr == sorted(sr, reverse=True) and sr[-1] < 0.011  # O(k/M)


def test_fixed_chunks_lower_in_place_to_056():
    m = _plan(VOCAB, 64, 8, chunk_bytes=4096).memory()
    assert 0.56 <= m["area_rs_ns"] < 0.565  # paper: "fixed-size chunks lower In-Place to 0.56 NS"


def test_arena_regions():
    p = _plan([(1000, 64), (33,)], 4, 8)
    m = p.memory()
    assert [r["name"] for r in m["arena"]] == REGIONS
    end = 0
    for r in m["arena"]:
        assert r["offset"] % 4096 == 0 and r["offset"] >= end
        end = r["offset"] + r["bytes"]
    assert m["arena_bytes"] >= end and m["arena_bytes"] % 4096 == 0
    size = {r["name"]: r["bytes"] for r in m["arena"]}
    g = p.layout
    assert size["ring0"] == size["ring1"] == g.NS
    assert size["resident"] == g.S
    assert size["stage"] == 3 * g.S  # (M-1) S without a cast
    assert size["counters"] == 64 << 10
    assert size["staging"] + size["outbox"] + size["inbox"] + size["spare"] == m["area_rs_bytes"]
    assert p.region("inbox") == (m["arena"][6]["offset"], size["inbox"])
    with pytest.raises(RuntimeError, match="no region 'nope'"):
        p.region("nope")


def test_cast_moves_resident_into_stage():
    p = _plan([(1000, 64)], 4, 8, ag_dtype="bfloat16", shard_dtype="float32")
    names = [r["name"] for r in p.memory()["arena"]]
    assert "resident" not in names
    assert p.memory()["stage_bytes"] == 4 * p.layout.S  # MS with a cast
    with pytest.raises(RuntimeError, match="resident"):
        p.region("resident")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(1, 5000), st.integers(1, 64),
       st.sampled_from(["in_place", "slot_reuse"]), st.sampled_from(["bfloat16", "float32"]))
def test_laid_out_area_within_eq10_bound(M, L, D, K, mode, grad):
    p = _plan([(D, K)], M, L, mode, grad_dtype=grad)
    m, rs = p.memory(), p.rs
    b_grad = 4 if grad == "float32" else 2
    # Eq. 10 in general form bounds the layout up to E_sub's alignment padding (< 8 elements per
    # row: kSubsliceAlignElems, 16 bytes of bf16).
    pad = 8
    slack = (2 * (L - 1) * L * pad * b_grad + 4 * pad * L * (L * rs["n_par"] + 2 * rs["n_out"] + 2))
    assert m["area_rs_bytes"] <= m["area_rs_bound_ns"] * m["NS_bytes"] + slack + 1e-6
    assert m["live_tide_bytes"] == (m["ring_bytes"] + m["stage_bytes"] + m["area_rs_bytes"]
                                   + m["prev_grad_bytes"])
    assert m["live_fsdp2_bytes"] == 2 * m["NS_bytes"] + p.layout.B_pack


BIG_GROUPS = [("llama3.1-70b", "block"), ("qwen3-30b-a3b", None), ("wan2.2-14b", None)]


@pytest.mark.parametrize("model,group", BIG_GROUPS, ids=[g[0] for g in BIG_GROUPS])
def test_live_bytes_within_fsdp2_on_every_topology(model, group):
    """Section 5.4 with the planner's chunk and passes: one node holds no more than FSDP2 (the RS
    scratch is staging only, <= 4 output blocks), Slot-Reuse stays below FSDP2 at every M,
    In-Place within 4.5 NS at 2 x 8, and the paper's 64 x 8 totals hold."""
    from tide import models
    sig = models.signature(model, group or models.largest_group_name(model))
    for M in (1, 2, 3, 4, 8, 16, 64):
        for mode in ("in_place", "slot_reuse"):
            p = tide.plan(sig, tide.Topology(M, 8), mode)
            m = p.memory()
            assert m["area_rs_bytes"] == m["staging_bytes"] + m["inbox_bytes"] + m["outbox_bytes"] + m["spare_bytes"]
            blocks = m["area_rs_bytes"] / p.layout.S_fp32
            if M == 1:
                assert m["inbox_bytes"] == m["outbox_bytes"] == m["spare_bytes"] == 0
                assert blocks <= 4 and m["live_tide_ns"] <= m["live_fsdp2_ns"] == 4.0, (mode, m)
            if mode == "slot_reuse":
                assert m["live_tide_ns"] < m["live_fsdp2_ns"], (M, m["live_tide_ns"])
            if (M, mode) == (2, "in_place"):
                assert m["live_tide_ns"] <= 4.5
            if M == 64:
                assert m["live_tide_ns"] <= (3.72 if mode == "in_place" else 2.29)
            assert "n_part" in p.rs_sizing and "chunk" in p.rs_sizing


@pytest.mark.parametrize("out_mib", [32, 128])
def test_slot_reuse_scratch_stays_flat_from_2_to_8_nodes(out_mib):
    """Fig. 10b: a fixed per-rank fp32 output; Slot-Reuse's RS scratch stays within 21 output
    blocks from 2 to 8 nodes (the planner takes passes where one pass's outbox would grow)."""
    E = out_mib * (1 << 20) // 4
    for M in (2, 3, 4, 6, 8):
        N = M * 8
        p = tide.plan(tide.GroupSignature(shapes=[(N * E // 4096, 4096)]), tide.Topology(M, 8), "slot_reuse")
        assert p.layout.S_fp32 == out_mib << 20
        assert p.memory()["area_rs_bytes"] <= 21 * p.layout.S_fp32, (M, p.rs_sizing)
