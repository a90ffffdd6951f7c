"""A Shard(k > 0) parameter as rows (tide/plan.py [Note: Shard(k) as rows]): its A rows planned as
dim-0 items of shape (N, c) land each rank's columns at their strided place in the row-major
unsharded tensor (Eq. 2 unchanged), and TIDE-RS over the rows of the unsharded gradient writes
each rank's Shard(k) shard; plan_classes keeps a parameter's rows in one plan."""
import numpy as np
import pytest

import tide
from tide import _core
from tide.plan import MAX_PARAMS, plan_classes, shard_rows

KIND = dict(_core.buf_kinds)


def test_shard_rows_shapes_and_errors():
    assert shard_rows((4, 32, 16), 1, 4) == (4, (4, 8 * 16))  # torchtitan's experts: (E, out, in)
    assert shard_rows((6, 8), 1, 2) == (6, (2, 4))
    assert shard_rows((2, 3, 8, 5), 2, 4) == (6, (4, 10))
    with pytest.raises(tide.PlanError, match="does not divide"):
        shard_rows((4, 6), 1, 4)
    with pytest.raises(tide.PlanError, match="shard dim 0"):
        shard_rows((4, 8), 0, 4)


@pytest.mark.parametrize("M,L", [(1, 4), (2, 2)])
def test_rows_land_strided_and_reduce_to_the_column_shard(M, L):
    N = M * L
    topo = tide.Topology(nodes=M, gpus_per_node=L)
    shape, dim = (3, 4 * N, 5), 1                       # (experts, out, in), Shard(1)
    rows, item = shard_rows(shape, dim, N)
    lead = (7, 5)                                       # a dim-0 parameter ahead of it
    sig = tide.GroupSignature(shapes=[lead] + [item] * rows, ag_dtype="float32",
                              grad_dtype="float32")
    plan = tide.plan(sig, topo)
    lay = plan.layout
    rng = np.random.default_rng(0)
    W = rng.standard_normal(shape).astype(np.float32)
    X = rng.standard_normal(lead).astype(np.float32)
    cols = shape[dim] // N
    # Rank r's FSDP2 shard: columns [r c, (r+1) c) of every row, contiguous (rows, c').
    local = [np.ascontiguousarray(W[:, r * cols:(r + 1) * cols]) for r in range(N)]
    R0 = -(-lead[0] // N)
    lead_shards = [np.zeros((R0, lead[1]), np.float32) for _ in range(N)]
    for r in range(N):
        part = X[r * R0:(r + 1) * R0]
        lead_shards[r][:len(part)] = part
    shards = [[lead_shards[r]] + list(local[r].reshape(rows, -1)) for r in range(N)]
    vc = tide.VirtualCluster(topo, timeout_s=10)
    vc.all_gather(plan, shards, resident=False)
    # The ring slot holds W row-major at item 1's landing: no copy-out would be needed.
    base = lay.landing(1, 0)
    for r in range(N):
        raw = np.empty(lay.S * N, dtype=np.uint8)
        vc.arena(plan).read(r, KIND["ring0"], 0, raw)
        got = raw[base:base + W.nbytes].view(np.float32).reshape(shape)
        assert np.array_equal(got, W), r
    # TIDE-RS over the rows of each rank's unsharded gradient: rank r's output is its column shard.
    grads = [[rng.integers(-8, 8, size=lead).astype(np.float32)] + [None] * rows for _ in range(N)]
    G = [rng.integers(-8, 8, size=shape).astype(np.float32) for _ in range(N)]
    for r in range(N):
        grads[r][1:] = list(G[r].reshape(rows, *item))
    outs = vc.reduce_scatter(plan, grads)
    total = sum(G)
    for r in range(N):
        e0 = lay.params[0].e
        got = outs[r][e0:e0 + total.size // N].reshape(shape[0], cols, shape[2])
        assert np.array_equal(got, total[:, r * cols:(r + 1) * cols]), r


def test_plan_classes_keeps_bundles_whole():
    topo = tide.Topology(nodes=1, gpus_per_node=2)
    shapes = [(2, 4)] * (MAX_PARAMS + 40)
    dtypes = [("bfloat16",) * 3] * len(shapes)
    bundles = [0] * 20 + [1] * 250 + [2] * 26                # 20 + 250 > MAX_PARAMS
    pieces = plan_classes(shapes, dtypes, topo, bundles=bundles)
    assert [len(m) for m, _ in pieces] == [20, 250, 26]  # never a bundle across two plans
    assert [len(m) for m, _ in plan_classes(shapes, dtypes, topo)] == [MAX_PARAMS, 40]
