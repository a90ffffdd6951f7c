"""`tide bench layout`'s groups beyond the bf16 dim-0 blocks (tide_apps/bench/layout_rows.py):
llama70b_fp8 (torchao's Float8 all-gather: 1-byte items) and moe_shard1 (grouped experts on
Shard(1), planned as rows, tide/plan.py [Note: Shard(k) as rows]). The bench itself needs a GPU;
here the groups' plans and bytes are checked at full size, and FSDP2's stock layout path
(StockAllGather, the Shard(k) gradient reorder) runs on torch-CPU against the CPU virtual cluster's
TIDE programs on small groups of the same kinds, bit for bit, as the bench checks them on the GPU.
"""
from __future__ import annotations

from math import prod

import numpy as np
import pytest

import tide
from tide import _core

torch = pytest.importorskip("torch")

from tide_apps.bench import layout, layout_rows as lr  # noqa: E402
from tide_apps.bench.collectives import _np_bf16  # noqa: E402

L = 8


def _plan(g, world=L):
    return tide.plan(lr.signature(g, world), tide.Topology(1, world))


def test_groups_are_named_on_the_command_line():
    assert set(layout.NAMES) >= {"llama70b", "qwen3", "wan22", "llama70b_fp8", "moe_shard1"}
    assert layout.GROUPS == lr.GROUPS  # the plain groups other tools plan (tools/gpu/rsdiag.py, rssweep.py)
    with pytest.raises(SystemExit):
        layout.main(["--groups", "llama70b,nope"])


def test_fp8_group_moves_half_the_bytes_of_bf16():
    """The 70B block's seven Linear weights as 1-byte items: the plan's shard and every rank's AG
    program bytes are half of the same weights in bf16, and the item shapes are the weights'."""
    g = lr.group("llama70b_fp8")
    assert g.item == "uint8" and not g.rs and len(g.params) == 7
    assert all(len(shape) == 2 and dim == 0 for _, shape, dim in g.params)
    fp8, bf16 = _plan(g), tide.plan(layout.group_signature(g, L, "bfloat16"), tide.Topology(1, L))
    assert _core.plan_dtypes(fp8)[0] == "uint8"
    elements = sum(prod(shape) for _, shape, _ in g.params)
    assert fp8.layout.S * L == elements and bf16.layout.S == 2 * fp8.layout.S
    b8 = layout.program_bytes(_core, _core.build_ag_programs(fp8), L)
    b16 = layout.program_bytes(_core, _core.build_ag_programs(bf16), L)
    assert b8 * 2 == b16 == 2 * L * (L * bf16.layout.S)  # direct landing: 2 N S bytes per rank


def test_plain_groups_plan_as_before():
    """A plain group's signature is tide.models' block (the bench's earlier rows are unchanged)."""
    from tide import models
    for name, model in lr.GROUPS.items():
        g = lr.group(name)
        want = models.signature(model, "block")
        assert [tuple(s) for s in lr.signature(g, L).shapes] == [tuple(s) for s in want.shapes]
        assert layout.group_signature(g, L) == want


def test_moe_shard1_rows_land_as_the_unsharded_tensor():
    """64 experts' w1/w2/w3 on Shard(1): 64 rows each, consecutive items; row a of rank r lands at
    landing(first, 0) + a N s + r s, so the rows back to back are the row-major unsharded tensor."""
    g = lr.group("moe_shard1")
    assert [shape for _, shape, _ in g.params] == [(64, 768, 2048), (64, 2048, 768), (64, 768, 2048)]
    assert all(dim == 1 for _, _, dim in g.params) and g.rs
    plan = _plan(g)
    lay = plan.layout
    assert lay.P == 3 * 64
    first = 0
    for _, shape, _ in g.params:
        s = lay.params[first].s
        assert s == shape[1] // L * shape[2] * 2
        for a in (0, 1, 63):
            for r in (0, 3, L - 1):
                assert lay.landing(first + a, r) == lay.landing(first, 0) + a * L * s + r * s
        first += 64
    assert lay.S * L == 2 * sum(prod(shape) for _, shape, _ in g.params)


def _cpu_all_gather(g, world):
    plan = _plan(g, world)
    shards = lr.make_shards(torch, g, world, "cpu")
    conv = (lambda x: x.numpy()) if g.item == "uint8" else _np_bf16
    full = tide.VirtualCluster(tide.Topology(1, world)).all_gather(
        plan, [[conv(x) for x in lr.item_shards(g, world, shards[r])] for r in range(world)])
    return shards, [[torch.from_numpy(np.ascontiguousarray(f).view(np.uint8)) for f in full[r]] for r in range(world)]


@pytest.mark.parametrize("g", [lr.moe_shard1(experts=3, dim=64, moe=32),
                               lr.Group("fp8", (("a", (64, 32), 0), ("b", (24, 64), 0)), item="uint8", rs=False),
                               lr.Group("mixed", (("e", (2, 16, 8), 1), ("n", (20,), 0), ("f", (4, 8, 16), 2)))],
                         ids=["shard1", "fp8", "mixed"])
def test_stock_all_gather_equals_the_tide_landing(g):
    """FSDP2's stock path (copy-in, rank-major collective, split_with_sizes_copy, cat on dim k) and
    the CPU cluster's TIDE-AG landing give every rank the same unsharded bytes; both equal the
    shards put together directly."""
    world = 4
    shards, full = _cpu_all_gather(g, world)
    st = lr.StockAllGather(torch, g, shards, world)
    st()
    for p, (_, shape, dim) in enumerate(g.params):
        direct = torch.cat([shards[j][p] for j in range(world)], dim=dim)[tuple(slice(0, d) for d in shape)]
        assert torch.equal(st.unsharded(0)[p], direct.contiguous().reshape(-1).view(torch.uint8)), p
    for r in range(world):
        got, want = lr.unsharded_from_items(torch, g, world, full[r]), st.unsharded(r)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), r
    b, Es = g.item_size, sum(s.numel() for s in shards[0])
    assert st.bytes["copy_in"] == 2 * b * world * Es and st.bytes["collective"] == world * st.bytes["copy_in"]


def test_fp8_items_are_float8_bytes():
    g = lr.Group("fp8", (("a", (16, 32), 0),), item="uint8", rs=False)
    (x,), = lr.make_shards(torch, g, 1, "cpu")
    assert x.dtype == torch.uint8 and x.view(torch.float8_e4m3fn).float().isfinite().all()


def test_shard1_reduce_scatter_stock_equals_tide():
    """The Shard(1) RS: FSDP2's reorder + _chunk_cat + reduce, against the CPU cluster's TIDE-RS
    over the gradient rows read in place (item_grads are views of the unsharded gradient)."""
    world = 4
    g = lr.moe_shard1(experts=3, dim=64, moe=32)
    plan = _plan(g, world)
    whole = lr.make_grads(torch, g, world, "cpu")
    items = [lr.item_grads(g, world, whole[u]) for u in range(world)]
    assert all(t.untyped_storage().data_ptr() == whole[0][0].untyped_storage().data_ptr()
               for t in items[0][:3])
    outs = tide.VirtualCluster(tide.Topology(1, world)).reduce_scatter(
        plan, layout._np_grads(torch, items), scale=1 / world)
    Es = sum(prod(lr.shard_shape(s, d, world)) for _, s, d in g.params)
    packed = torch.empty(world, world, Es)
    for u in range(world):
        inputs = lr.stock_rs_inputs(torch, g, world, whole[u])
        assert [tuple(t.shape) for t in inputs] == [lr.reordered_shape(s, d, world) for _, s, d in g.params]
        torch._chunk_cat(inputs, dim=0, num_chunks=world, out=packed[u])
    stock = packed.sum(0) * (1 / world)
    lay = layout._layout(plan)
    assert layout.rs_diff(torch, lay, [torch.from_numpy(o) for o in outs],
                          [layout._plan_layout(torch, lay, stock[r]) for r in range(world)]) is None
    assert lr.stock_rs_reorder_bytes(g, world) == 4 * world * sum(prod(s) for _, s, _ in g.params)


def test_summary_lines_of_an_ag_only_group(capsys):
    """The verdict and summary of a result holding an AG-only group (fp8) beside a full one."""
    def rows(group, rs):
        out = [dict(step=layout.AG_STOCK, ms=2.0, bytes=8, floor_ms=1.0),
               dict(step=layout.AG_STOCK_FULL, ms=2.5, bytes=10, floor_ms=1.0),
               dict(step="AG TIDE: all_gather call, copy_2d batch, 4 lane(s)", ms=1.0, bytes=4, floor_ms=0.5)]
        if rs:
            out += [dict(step=s, ms=3.0, bytes=6, floor_ms=1.0, sum_ctas=8, land_ctas=8)
                    for s in (layout.RS_STOCK, layout.RS_TIDE, layout.RS_FULL)]
        for r in out:
            r.update(group=group, gbps=1.0, kernels=0, copies=0, sm_ms=0.0, parts={})
        return out
    result = dict(rows=[], groups=[])
    for name, rs in (("moe_shard1", True), ("llama70b_fp8", False)):
        info = dict(group=name, P=3, NS=1e9, exec_lanes=4, rs=rs, item="uint8" if not rs else "bfloat16",
                    ag_landing_bitwise=True)
        if rs:
            info.update(rs_reference_bitwise=True, rs_reference="CPU VirtualCluster", rs_reference_diff=None,
                        rs_stock_bitwise=True, sum_full_ctas=8, land_full_ctas=8, sum_ctas_solver=4,
                        land_ctas_solver=4)
        else:
            info["ag_bytes_vs_bf16"] = 0.5
        rr = rows(name, rs)
        layout._verdict(info, {r["step"]: r for r in rr})
        result["rows"] += rr
        result["groups"].append(info)
    assert result["groups"][1]["ag_time_ratio"] == 0.5 and result["groups"][1]["ag_full_time_ratio"] == 0.4
    assert "rs_time_ratio" not in result["groups"][1] and result["groups"][0]["rs_time_ratio"] == 1.0
    layout._print(result)
    out = capsys.readouterr().out
    assert "uint8 items: AG bytes 0.50 x the bf16 group's" in out
    assert "RS full grid 1.00 (moe_shard1); bitwise checks ok" in out
    assert "AG 0.50/0.50 (moe_shard1, llama70b_fp8), with copy-in 0.40/0.40" in out
