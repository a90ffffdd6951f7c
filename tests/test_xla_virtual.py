"""tide_apps.xla_virtual on XLA:CPU: N virtual ranks on one device through the FFI targets equal the
CPU VirtualCluster and the numpy reference bit for bit (exact integer data). The CUDA twin of
these checks is tests/test_xla_gpu.py."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import tide  # noqa: E402
from tide_xla import _ffi  # noqa: E402
from tide_apps.xla_virtual import stack_shards, virtual_all_gather, virtual_reduce_scatter  # noqa: E402

pytestmark = pytest.mark.skipif(not _ffi.executor_available("cpu"), reason=_ffi.executor_description("cpu"))

SHAPES = [(10, 3), (5,), (16, 8), (3, 2, 2), (1, 7)]
BF16 = np.dtype(ml_dtypes.bfloat16)


def ints(shape, seed, lo=-64, hi=64):
    return np.random.default_rng(seed).integers(lo, hi, size=shape).astype(np.float32)


def cluster_plan(topo, shard_dtype=None):
    t = tide.Topology(nodes=topo[0], gpus_per_node=topo[1])
    return t, tide.plan(tide.GroupSignature(shapes=SHAPES, shard_dtype=shard_dtype), t)


@pytest.mark.parametrize("topo", [(2, 2), (1, 4), (4, 1), (2, 4)])
@pytest.mark.parametrize("shard_dtype", ["bfloat16", "float32"])
def test_virtual_all_gather_equals_cluster_and_reference(topo, shard_dtype):
    n = topo[0] * topo[1]
    dev = jax.devices("cpu")[0]
    fulls = [ints(s, i) for i, s in enumerate(SHAPES)]
    sd = BF16 if shard_dtype == "bfloat16" else np.float32
    stacked = [jax.device_put(stack_shards(jnp.asarray(f.astype(sd)), n), dev) for f in fulls]
    got = virtual_all_gather(stacked, [s[0] for s in SHAPES], topo, ag_dtype=jnp.bfloat16)
    t, plan = cluster_plan(topo, None if shard_dtype == "bfloat16" else "float32")
    shards = [[np.array(stacked[p][r]) for p in range(len(SHAPES))] for r in range(n)]
    want = tide.VirtualCluster(t).all_gather(plan, shards)
    for p, f in enumerate(fulls):
        g = np.asarray(got[p])
        assert g.shape == (n, *SHAPES[p]) and g.dtype == BF16
        for r in range(n):
            np.testing.assert_array_equal(g[r].view(np.uint16), f.astype(BF16).view(np.uint16))
            np.testing.assert_array_equal(g[r].view(np.uint16),
                                          np.asarray(want[r][p]).astype(BF16).view(np.uint16))


@pytest.mark.parametrize("topo", [(2, 2), (1, 4), (4, 1)])
def test_virtual_reduce_scatter_equals_cluster_and_sum(topo):
    n = topo[0] * topo[1]
    grads = [np.stack([ints(s, 100 * r + p) for r in range(n)]) for p, s in enumerate(SHAPES)]
    got = np.asarray(virtual_reduce_scatter([jnp.asarray(g.astype(BF16)) for g in grads], topo,
                                            scale=0.5))
    t, plan = cluster_plan(topo)
    want = tide.VirtualCluster(t).reduce_scatter(
        plan, [[g[r].astype(BF16) for g in grads] for r in range(n)], scale=0.5)
    for r in range(n):
        np.testing.assert_array_equal(got[r], np.asarray(want[r], np.float32))
    off = 0
    for g in grads:  # numpy: rank r's rows of 0.5 * the sum over ranks
        rows = -(-g.shape[1] // n)
        total = 0.5 * np.pad(g.sum(0), [(0, n * rows - g.shape[1])] + [(0, 0)] * (g.ndim - 2))
        e = rows * int(np.prod(g.shape[2:], dtype=np.int64))
        for r in range(n):
            np.testing.assert_array_equal(got[r, off:off + e],
                                          total[r * rows:(r + 1) * rows].ravel())
        off += e
    assert got.shape == (n, off)


def test_virtual_reduce_scatter_accumulates_into_the_aliased_buffer():
    topo, n = (2, 2), 4
    grads = [jnp.asarray(np.stack([ints(s, 7 * r + p) for r in range(n)]).astype(BF16))
             for p, s in enumerate(SHAPES)]
    first = virtual_reduce_scatter(grads, topo)
    acc = jnp.asarray(ints(first.shape, 99))
    step = jax.jit(lambda a, g: virtual_reduce_scatter(g, topo, accumulate=a), donate_argnums=0)
    want = np.asarray(acc) + np.asarray(first)
    got = step(acc, grads)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_virtual_rejects_a_stack_that_is_not_the_world():
    x = jnp.zeros((3, 3, 3), jnp.bfloat16)  # 3 ranks stacked, topology says 4
    with pytest.raises(ValueError, match=r"shards\[0\] has shape \(3, 3, 3\); expected \(4, 3"):
        virtual_all_gather([x], [10], (2, 2))
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(3, 3, 3\); expected \(4, D_p"):
        virtual_reduce_scatter([x], (1, 4))
