"""Bad inputs to the VirtualCluster face are refused by name, never rounded or padded silently.

A shard with fewer rows than its rank owns, a tensor of another dtype whose values the plan's
dtype cannot hold exactly (fp32 -> bf16 rounding, 1e30, complex), an extra or missing tensor and a
lossy accumulate buffer each raise tide.PlanError naming the op, rank and parameter; inputs whose
values the plan's dtype holds exactly (integer-valued fp32 for a bf16 plan) are taken and give the
same bits as inputs already in the plan's dtype.
"""
import ml_dtypes
import numpy as np
import pytest

import tide

pytestmark = pytest.mark.usefixtures("no_leaks")  # conftest.py: no segment, no child left

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [[10, 3], [7], [5, 4]]


def _setup(ranks_as="threads"):
    topo = tide.Topology(1, 4)
    plan = tide.plan(tide.GroupSignature(shapes=SHAPES, names=["a", "b", "c"]), topo)
    vc = tide.VirtualCluster(topo, ranks_as=ranks_as)
    rng = np.random.default_rng(3)
    full = [rng.integers(-8, 9, size=s).astype(np.float32) for s in SHAPES]
    lay = plan.layout
    shards = [[full[p][r * lay.params[p].R:(r + 1) * lay.params[p].R] for p in range(len(SHAPES))]
              for r in range(4)]
    return vc, plan, full, shards


def _expect(fn, *needles):
    with pytest.raises(tide.PlanError) as e:
        fn()
    msg = str(e.value)
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_exact_values_of_another_dtype_are_taken_bit_for_bit():
    vc, plan, full, shards = _setup()
    as_bf16 = [[s.astype(BF16) for s in row] for row in shards]
    a = vc.all_gather(plan, shards)
    b = vc.all_gather(plan, as_bf16)
    for r in range(4):
        for p in range(len(SHAPES)):
            assert a[r][p].dtype == BF16
            assert np.array_equal(a[r][p].view(np.uint16), b[r][p].view(np.uint16))
            assert np.array_equal(a[r][p].astype(np.float32), full[p])


@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
def test_short_shard_of_a_non_last_rank_is_refused(ranks_as):
    vc, plan, _, shards = _setup(ranks_as)
    shards[1][0] = shards[1][0][:2]  # rank 1 owns R_0 = 3 full rows
    _expect(lambda: vc.all_gather(plan, shards), "all_gather: shards[1][0]", "6 elements", "expected 9")


def test_last_rank_takes_its_valid_rows_or_the_padded_shard():
    vc, plan, full, shards = _setup()
    lay = plan.layout
    p = 0
    last = lay.valid_rows(p, 3)
    assert last < lay.params[p].R  # the fixture's last rank holds a short shard
    padded = np.zeros((lay.params[p].R, 3), np.float32)
    padded[:last] = shards[3][p]
    a = vc.all_gather(plan, shards)
    shards[3][p] = padded
    b = vc.all_gather(plan, shards)
    assert np.array_equal(a[0][p].view(np.uint16), b[0][p].view(np.uint16))
    shards[3][p] = padded[: last - 1] if last > 1 else padded[:0].reshape(0, 3)
    _expect(lambda: vc.all_gather(plan, shards), "all_gather: shards[3][0]")


@pytest.mark.parametrize("value,kind", [(0.1, np.float32), (1e30, np.float32), (1.0 + 1j, np.complex64),
                                        (3.0 + 2 ** -20, np.float64)])
def test_values_the_plan_dtype_cannot_hold_are_refused(value, kind):
    vc, plan, _, shards = _setup()
    shards[2][1] = (shards[2][1] + np.asarray(value)).astype(kind)
    msg = _expect(lambda: vc.all_gather(plan, shards), "all_gather: shards[2][1]", f"dtype {np.dtype(kind)}",
                  "bfloat16", "never rounds")
    if kind is not np.complex64:
        assert "first at element " in msg and "would become" in msg


def test_reduce_scatter_refuses_lossy_gradients_and_accumulate():
    vc, plan, full, _ = _setup()
    grads = [[f.copy() for f in full] for _ in range(4)]
    ok = vc.reduce_scatter(plan, grads)  # integer-valued fp32: exact in bf16
    ref = vc.reduce_scatter(plan, [[g.astype(BF16) for g in row] for row in grads])
    for a, b in zip(ok, ref):
        assert np.array_equal(a.view(np.int32), b.view(np.int32))
    grads[3][2] = grads[3][2] * 1.001
    _expect(lambda: vc.reduce_scatter(plan, grads), "reduce_scatter: grads[3][2]", "float32", "bfloat16")
    grads[3][2] = full[2].copy()
    acc = [np.full(plan.layout.E, 0.1, np.float64) for _ in range(4)]
    _expect(lambda: vc.reduce_scatter(plan, grads, accumulate=acc), "reduce_scatter: accumulate[0]",
            "float64", "float32")
    acc = [np.full(plan.layout.E, 0.5, np.float64) for _ in range(4)]  # exact in fp32: taken
    out = vc.reduce_scatter(plan, grads, accumulate=acc)
    assert np.array_equal(out[0] - 0.5, ok[0])


def test_counts_of_ranks_and_tensors_are_refused():
    vc, plan, full, shards = _setup()
    _expect(lambda: vc.all_gather(plan, shards[:3]), "all_gather", "3 ranks", "4")
    extra = [list(row) for row in shards]
    extra[2].append(extra[2][0])
    _expect(lambda: vc.all_gather(plan, extra), "all_gather: shards[2]", "4 tensors", "3")
    grads = [[f.copy() for f in full] for _ in range(4)]
    grads[1].append(full[0])
    _expect(lambda: vc.reduce_scatter(plan, grads), "reduce_scatter: grads[1]", "4 tensors", "3")
    grads[1] = [full[0], full[1], full[2][:4]]
    _expect(lambda: vc.reduce_scatter(plan, grads), "reduce_scatter: grads[1][2]", "16 elements")
