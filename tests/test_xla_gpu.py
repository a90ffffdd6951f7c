"""tide_xla on CUDA: the CUDA FFI handlers (CudaExecutor over an InProcessFabric) equal
jax.lax.all_gather / psum_scatter of upcast gradients and the CPU path bit for bit on exact
(small-integer) data; the one-GPU virtual cluster equals the CPU virtual target, the CPU mesh
path and tide.VirtualCluster.

Run on the GPU machine (tools/gpu/run.py xlacuda): python3 -m pytest -q tests/test_xla_gpu.py
"""
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch tests share the GPU
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the CPU path

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import tide  # noqa: E402
import tide_xla  # noqa: E402
from tide_xla import _ffi  # noqa: E402
from tide_apps.xla_virtual import stack_shards, virtual_all_gather, virtual_reduce_scatter  # noqa: E402


def _devices(platform):
    try:
        return jax.devices(platform)
    except RuntimeError:
        return []


GPUS = _devices("gpu")
CPUS = _devices("cpu")
BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = {"a": (10, 3), "b": (5,), "c": (16, 8), "d": (3, 2, 2), "e": (1, 7)}
TARGETS = {"tide_all_gather", "tide_reduce_scatter", "tide_all_gather_virtual",
           "tide_reduce_scatter_virtual"}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _ffi.built_with_cuda, reason="tide_xla._ffi built without CUDA"),
    pytest.mark.skipif(not GPUS, reason="jax has no GPU backend here"),
]
two_gpus = pytest.mark.skipif(len(GPUS) < 2, reason="needs jax.device_count('gpu') >= 2")


def ints(shape, seed, lo=-32, hi=32):
    """Small integers: every bf16 value and every fp32 partial sum below is exact."""
    return np.random.default_rng(seed).integers(lo, hi, size=shape).astype(np.float32)


def stacked(tree):
    return jax.tree.map(lambda x: x[None], tree)


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


# ---- registration ------------------------------------------------------------------------------
def test_cuda_targets_are_registered_and_lowered():
    assert set(_ffi.registrations()["CUDA"]) == TARGETS
    mesh = Mesh(np.array(GPUS[:1]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(1, 1), serve_single_rank=True)
    sharded, layout = tide_xla.shard({"a": jnp.ones((4, 2))}, mesh, "fsdp")
    fn = jax.jit(jax.shard_map(lambda s: tide_xla.gather(s, layout)["a"][None], mesh=mesh,
                               in_specs=(layout.specs,), out_specs=P("fsdp")))
    text = fn.lower(sharded).as_text()
    assert "tide_all_gather" in text
    np.testing.assert_array_equal(np.asarray(fn(sharded), np.float32)[0], 1.0)


def test_cuda_handler_rejects_a_shard_that_is_not_padded_dim0():
    from tide_xla.all_gather import AllGatherPrimitive
    mesh = Mesh(np.array(GPUS[:1]), ("fsdp",))
    ctx = tide_xla.init(mesh, "fsdp", topology=(1, 1), serve_single_rank=True)

    def local(x):  # the shard has 2 rows, dims0 says D = 40 -> R_p should be 40
        return AllGatherPrimitive.bind(ctx, [x], [40], jnp.bfloat16)[0][None]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"),), out_specs=P("fsdp"),
                               check_vma=False))
    with pytest.raises(Exception, match=r"INVALID_ARGUMENT.*R_p = ceil\(D_p/N\)"):
        jax.block_until_ready(fn(jnp.ones((2, 4), jnp.bfloat16)))


# ---- a mesh of real GPUs through the CUDA handlers ---------------------------------------------
def gather_and_grad(devs, topology, seed):
    """TIDE-AG vs jax.lax.all_gather, and gather's gradient (TIDE-RS) vs the exact sum of every
    device's cotangent; three steps with new data (call seqs 1..3, both RS banks)."""
    n = len(devs)
    mesh = Mesh(np.array(devs), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology, serve_single_rank=True)
    leaves = None
    for step in range(3):
        params = {k: jnp.asarray(ints(s, seed + 10 * step + i))
                  for i, (k, s) in enumerate(SHAPES.items())}
        sharded, layout = tide_xla.shard(params, mesh, "fsdp")  # fp32 masters, 5 groups
        leaves = jax.tree.unflatten(layout.treedef, layout.leaves)
        cots = {k: ints((n, *s), seed + 100 + 10 * step + i)
                for i, (k, s) in enumerate(SHAPES.items())}

        def local(s, c):
            c = jax.tree.map(lambda x: x[0], c)

            def loss(s):
                full = tide_xla.gather(s, layout)
                return sum(jnp.sum(full[k].astype(jnp.float32) * c[k]) for k in full)

            full = tide_xla.gather(s, layout)
            ref = jax.tree.map(lambda x, leaf: jax.lax.all_gather(
                x.astype(jnp.bfloat16), "fsdp", tiled=True)[: leaf.shape[0]], s, leaves)
            return stacked(full), stacked(ref), jax.grad(loss)(s)

        per_dev = jax.tree.map(lambda _: P("fsdp"), params)
        fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs, per_dev),
                                   out_specs=(per_dev, per_dev, layout.specs)))
        full, ref, grads = fn(sharded, jax.tree.map(jnp.asarray, cots))
        grads = layout.unshard(grads)
        for k in SHAPES:
            np.testing.assert_array_equal(bits(full[k]), bits(ref[k]), err_msg=f"step {step} {k}")
            want = np.asarray(params[k]).astype(BF16)
            for r in range(n):
                np.testing.assert_array_equal(bits(np.asarray(full[k])[r]), bits(want))
            np.testing.assert_array_equal(bits(np.asarray(grads[k], np.float32)),
                                          bits(cots[k].sum(0)), err_msg=f"step {step} grad {k}")


def reduce_scatter_vs_psum_scatter(devs, topology, seed):
    """tide_xla.reduce_scatter (one group) == psum_scatter of upcast gradients, bit for bit."""
    n = len(devs)
    mesh = Mesh(np.array(devs), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology, serve_single_rank=True)
    _, layout = tide_xla.shard({k: jnp.zeros(s) for k, s in SHAPES.items()}, mesh, "fsdp",
                               group_key=lambda path: "one")

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        got = tide_xla.unpack_grads(tide_xla.reduce_scatter(g, layout), layout)

        def ref(x, leaf):
            pad = [(0, n * leaf.rows - leaf.shape[0])] + [(0, 0)] * (x.ndim - 1)
            return jax.lax.psum_scatter(jnp.pad(x.astype(jnp.float32), pad), "fsdp",
                                        scatter_dimension=0, tiled=True)
        return got, jax.tree.map(ref, g, jax.tree.unflatten(layout.treedef, layout.leaves))

    spec = {k: P("fsdp") for k in SHAPES}
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
    for step in range(3):
        grads = {k: jnp.asarray(ints((n, *s), seed + 10 * step + i), jnp.bfloat16)
                 for i, (k, s) in enumerate(SHAPES.items())}
        got, ref = fn(grads)
        for k in SHAPES:
            np.testing.assert_array_equal(bits(got[k]), bits(ref[k]), err_msg=f"step {step} {k}")


def test_one_gpu_gather_and_gradient():
    gather_and_grad(GPUS[:1], (1, 1), seed=1)


def test_one_gpu_reduce_scatter_equals_psum_scatter():
    reduce_scatter_vs_psum_scatter(GPUS[:1], (1, 1), seed=2)


def test_one_gpu_fp32_accumulation_in_place_through_donation():
    mesh = Mesh(np.array(GPUS[:1]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(1, 1), serve_single_rank=True)
    shapes = {"a": (10, 3), "c": (16, 8)}
    _, layout = tide_xla.shard({k: jnp.zeros(s) for k, s in shapes.items()}, mesh, "fsdp",
                               group_key=lambda path: "one")
    grads = {k: jnp.asarray(ints((1, *s), 5 + i), jnp.bfloat16)
             for i, (k, s) in enumerate(shapes.items())}
    spec = {k: P("fsdp") for k in shapes}

    @functools.partial(jax.jit, donate_argnums=(0,))
    def accumulate(acc, g):
        def local(acc, g):
            return tide_xla.reduce_scatter(jax.tree.map(lambda x: x[0], g), layout, accumulate=acc)
        return jax.shard_map(local, mesh=mesh, in_specs=([P("fsdp")], spec),
                             out_specs=[P("fsdp")])(acc, g)

    acc = tide_xla.zeros_packed(layout)
    ptr = acc[0].addressable_shards[0].data.unsafe_buffer_pointer()
    for _ in range(3):
        acc = accumulate(acc, grads)
    assert acc[0].addressable_shards[0].data.unsafe_buffer_pointer() == ptr  # in place
    want = np.concatenate([3 * np.asarray(grads[k], np.float32).ravel() for k in shapes])
    np.testing.assert_array_equal(np.asarray(acc[0]), want)


@two_gpus
@pytest.mark.parametrize("topology", [(1, 2), (2, 1)])
def test_two_gpus_gather_and_gradient(topology):
    gather_and_grad(GPUS[:2], topology, seed=3)


@two_gpus
@pytest.mark.parametrize("topology", [(1, 2), (2, 1)])
def test_two_gpus_reduce_scatter_equals_psum_scatter(topology):
    reduce_scatter_vs_psum_scatter(GPUS[:2], topology, seed=4)


# ---- the virtual cluster on one GPU vs the CPU -------------------------------------------------
def cpu_mesh_gather(fulls, topology, shard_dtype):
    """The CPU path: tide_xla.gather on a mesh of N host devices; [N, D_p, ...] per parameter."""
    n = topology[0] * topology[1]
    mesh = Mesh(np.array(CPUS[:n]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology, serve_single_rank=True)
    params = {f"p{i}": f for i, f in enumerate(fulls)}  # host arrays: shard() puts them on CPUs
    sharded, layout = tide_xla.shard(params, mesh, "fsdp", shard_dtype=shard_dtype,
                                     group_key=lambda path: "one")
    out_spec = jax.tree.map(lambda _: P("fsdp"), params)
    fn = jax.jit(jax.shard_map(lambda s: stacked(tide_xla.gather(s, layout)), mesh=mesh,
                               in_specs=(layout.specs,), out_specs=out_spec))
    got = fn(sharded)
    return [np.asarray(got[f"p{i}"]) for i in range(len(fulls))]


def cpu_mesh_reduce_scatter(grads, topology, scale):
    """The CPU path: tide_xla.reduce_scatter on a mesh of N host devices; [N, E]."""
    n = topology[0] * topology[1]
    mesh = Mesh(np.array(CPUS[:n]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology, serve_single_rank=True)
    _, layout = tide_xla.shard({f"p{i}": jnp.zeros(g.shape[1:]) for i, g in enumerate(grads)},
                               mesh, "fsdp", group_key=lambda path: "one")
    spec = {f"p{i}": P("fsdp") for i in range(len(grads))}
    fn = jax.jit(jax.shard_map(
        lambda g: tide_xla.reduce_scatter(jax.tree.map(lambda x: x[0], g), layout, scale=scale)[0],
        mesh=mesh, in_specs=(spec,), out_specs=P("fsdp")))
    return np.asarray(fn({f"p{i}": g for i, g in enumerate(grads)})).reshape(n, -1)  # host in


VIRTUAL_TOPOLOGIES = [(2, 2), (1, 4), (4, 1)]


@pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 host devices (XLA_FLAGS)")
@pytest.mark.parametrize("topology", VIRTUAL_TOPOLOGIES)
@pytest.mark.parametrize("shard_dtype", [jnp.bfloat16, jnp.float32])
def test_virtual_all_gather_on_one_gpu_equals_the_cpu(topology, shard_dtype):
    n = topology[0] * topology[1]
    dims0 = [s[0] for s in SHAPES.values()]
    t = tide.Topology(nodes=topology[0], gpus_per_node=topology[1])
    sd = None if shard_dtype == jnp.bfloat16 else "float32"
    plan = tide.plan(tide.GroupSignature(shapes=list(SHAPES.values()), shard_dtype=sd), t)
    run = jax.jit(lambda xs: virtual_all_gather(xs, dims0, topology, ag_dtype=jnp.bfloat16))
    for step in range(3):  # seqs 1..3 of one virtual group
        fulls = [ints(s, 20 * step + i) for i, s in enumerate(SHAPES.values())]
        stacks = [stack_shards(jnp.asarray(f, shard_dtype), n) for f in fulls]
        on_gpu = run([jax.device_put(x, GPUS[0]) for x in stacks])
        on_cpu = virtual_all_gather([jax.device_put(x, CPUS[0]) for x in stacks], dims0, topology,
                                    ag_dtype=jnp.bfloat16)
        mesh_cpu = cpu_mesh_gather(fulls, topology, shard_dtype)
        cluster = tide.VirtualCluster(t).all_gather(
            plan, [[np.array(x[r]) for x in stacks] for r in range(n)])
        for p, f in enumerate(fulls):
            g = np.asarray(on_gpu[p])
            assert g.shape == (n, *f.shape) and g.dtype == BF16
            np.testing.assert_array_equal(bits(g), bits(on_cpu[p]), err_msg=f"step {step} p {p}")
            np.testing.assert_array_equal(bits(g), bits(mesh_cpu[p]))
            for r in range(n):
                np.testing.assert_array_equal(bits(g[r]), bits(f.astype(BF16)))
                np.testing.assert_array_equal(bits(g[r]),
                                              bits(np.asarray(cluster[r][p]).astype(BF16)))


@pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 host devices (XLA_FLAGS)")
@pytest.mark.parametrize("topology", VIRTUAL_TOPOLOGIES)
def test_virtual_reduce_scatter_on_one_gpu_equals_the_cpu(topology):
    n = topology[0] * topology[1]
    t = tide.Topology(nodes=topology[0], gpus_per_node=topology[1])
    plan = tide.plan(tide.GroupSignature(shapes=list(SHAPES.values())), t)
    run = jax.jit(lambda g: virtual_reduce_scatter(g, topology, scale=0.5))
    acc_run = jax.jit(lambda a, g: virtual_reduce_scatter(g, topology, accumulate=a),
                      donate_argnums=0)
    acc = None
    for step in range(3):  # seqs 1..3: both outbox banks
        grads = [np.stack([ints(s, 100 * step + 10 * r + p) for r in range(n)]).astype(BF16)
                 for p, s in enumerate(SHAPES.values())]
        on_gpu = np.asarray(run([jax.device_put(g, GPUS[0]) for g in grads]))
        on_cpu = np.asarray(virtual_reduce_scatter([jax.device_put(g, CPUS[0]) for g in grads],
                                                   topology, scale=0.5))
        mesh_cpu = cpu_mesh_reduce_scatter(grads, topology, 0.5)
        cluster = tide.VirtualCluster(t).reduce_scatter(
            plan, [[g[r] for g in grads] for r in range(n)], scale=0.5)
        np.testing.assert_array_equal(bits(on_gpu), bits(on_cpu), err_msg=f"step {step}")
        np.testing.assert_array_equal(bits(on_gpu), bits(mesh_cpu))
        for r in range(n):
            np.testing.assert_array_equal(bits(on_gpu[r]), bits(np.asarray(cluster[r], np.float32)))
        prev = None if acc is None else np.asarray(acc)
        acc = acc_run(jnp.zeros_like(on_gpu, device=GPUS[0]) if acc is None else acc,
                      [jax.device_put(g, GPUS[0]) for g in grads])
        want = 2 * on_gpu + (0 if prev is None else prev)  # scale 1: twice the scale-0.5 result
        np.testing.assert_array_equal(np.asarray(acc), want)


@pytest.mark.parametrize("topology", [(2, 2), (1, 4)])
def test_virtual_large_group_on_one_gpu_equals_the_cpu(topology):
    """Sizes that take the kernels' vector paths and several CTAs (odd sizes for the tails)."""
    n = topology[0] * topology[1]
    shapes = [(1000, 520), (4097,), (333, 64)]
    fulls = [ints(s, 300 + i) for i, s in enumerate(shapes)]
    stacks = [stack_shards(jnp.asarray(f), n) for f in fulls]  # fp32 shards, cast to bf16
    dims0 = [s[0] for s in shapes]
    on_gpu = virtual_all_gather([jax.device_put(x, GPUS[0]) for x in stacks], dims0, topology,
                                ag_dtype=jnp.bfloat16)
    on_cpu = virtual_all_gather([jax.device_put(x, CPUS[0]) for x in stacks], dims0, topology,
                                ag_dtype=jnp.bfloat16)
    for p, f in enumerate(fulls):
        np.testing.assert_array_equal(bits(on_gpu[p]), bits(on_cpu[p]))
        np.testing.assert_array_equal(bits(np.asarray(on_gpu[p])[n - 1]), bits(f.astype(BF16)))
    grads = [np.stack([ints(s, 400 + 10 * r + p) for r in range(n)]).astype(BF16)
             for p, s in enumerate(shapes)]
    rs_gpu = virtual_reduce_scatter([jax.device_put(g, GPUS[0]) for g in grads], topology)
    rs_cpu = virtual_reduce_scatter([jax.device_put(g, CPUS[0]) for g in grads], topology)
    np.testing.assert_array_equal(bits(rs_gpu), bits(rs_cpu))
    total = np.pad(grads[0].astype(np.float32).sum(0), [(0, -(-1000 // n) * n - 1000), (0, 0)])
    rows = -(-1000 // n)
    for r in range(n):  # parameter 0 of rank r: its rows of the exact sum
        np.testing.assert_array_equal(np.asarray(rs_gpu)[r, : rows * 520],
                                      total[r * rows:(r + 1) * rows].ravel())


# ---- failures ---------------------------------------------------------------------------------
@two_gpus
def test_a_gpu_that_skips_the_call_fails_the_other_with_deadline_exceeded():
    mesh = Mesh(np.array(GPUS[:2]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(1, 2), timeout_s=1.0)
    shards, layout = tide_xla.shard({"a": jnp.ones((16, 4))}, mesh, "fsdp")

    def f(s):
        skip = jax.lax.axis_index("fsdp") == 1
        return jax.lax.cond(skip, lambda s: jnp.zeros((16, 4), jnp.bfloat16),
                            lambda s: tide_xla.gather(s, layout)["a"], s)[None]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(layout.specs,), out_specs=P("fsdp"),
                               check_vma=False))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(fn(shards))
    msg = str(info.value)
    assert "DEADLINE_EXCEEDED" in msg or "Deadline" in msg, msg
    assert "ranks [1]" in msg, msg
    tide_xla.init(mesh, "fsdp", topology=(1, 2))
