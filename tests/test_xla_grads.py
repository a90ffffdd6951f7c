"""TIDE-RS through XLA FFI: gradients of a small Flax NNX transformer equal a single-device
reference; exact-sum data is bit-equal to psum_scatter of upcast gradients; remat and the 2-D
mesh; fp32 accumulation in place through donation; an SGD step whose gathers pull across nodes
bit-equal to the one-node step."""
import functools
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402
from tide_xla import _ffi  # noqa: E402

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (XLA_FLAGS)"),
    pytest.mark.skipif(not _ffi.executor_available("cpu"), reason=_ffi.executor_description("cpu")),
]

VOCAB, DIM, HEADS, FF, LAYERS, SEQ = 37, 16, 2, 20, 1, 8


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, FF, rngs=rngs)
        self.down = nnx.Linear(FF, DIM, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def model_loss(graphdef, params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


def setup(mesh, topology, state):
    tide_xla.init(mesh, "fsdp", topology=topology)
    return tide_xla.shard(state, mesh, "fsdp")


def reference_grads(graphdef, state, tokens_per_device):
    """Per-device bf16 gradients (one device, vmapped), upcast and summed in fp32."""
    @jax.jit
    def grads(state, tokens):
        bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
        g = jax.vmap(jax.grad(lambda p, t: model_loss(graphdef, p, t)), in_axes=(None, 0))(
            bf, tokens)
        return jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32), 0), g)
    return grads(state, tokens_per_device)


def tide_grads(mesh, layout, graphdef, sharded, tokens, check_vma, remat=False):
    def local(s, t):
        def loss(s):
            return model_loss(graphdef, tide_xla.gather(s, layout), t)
        return jax.grad(jax.checkpoint(loss) if remat else loss)(s)

    batch_spec = P(mesh.axis_names)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs, batch_spec),
                               out_specs=layout.specs, check_vma=check_vma))
    return layout.unshard(fn(sharded, tokens))


def assert_close(got, want):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == np.float32 and g.shape == w.shape, jax.tree_util.keystr(path)
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * scale,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
    """Model, per-device token blocks (8 devices x 2 sequences) and the reference gradients,
    computed once for every mesh below (each device sees one block either way)."""
    graphdef, state = nnx.split(Transformer(nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (8, 2, SEQ + 1), 0, VOCAB)
    return graphdef, state, tokens, reference_grads(graphdef, state, tokens)


@pytest.mark.parametrize("topology,check_vma", [((2, 4), True), ((4, 2), False)])
def test_transformer_grads_match_single_device(reference, topology, check_vma):
    graphdef, state, tokens, want = reference
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharded, layout = setup(mesh, topology, state)
    got = tide_grads(mesh, layout, graphdef, sharded, tokens.reshape(16, SEQ + 1), check_vma)
    assert_close(got, want)


def test_grads_with_remat_and_2d_mesh(reference):
    """fsdp x data: TIDE-RS inside each fsdp group, then the replica sum over `data`; the gather
    is replayed by jax.checkpoint in the backward pass."""
    graphdef, state, tokens, want = reference
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "data"))
    sharded, layout = setup(mesh, (2, 2), state)
    got = tide_grads(mesh, layout, graphdef, sharded, tokens.reshape(16, SEQ + 1), True,
                     remat=True)
    assert_close(got, want)


@pytest.mark.parametrize("topology", [(2, 4), (4, 2)])
def test_exact_sum_bit_equal_to_psum_scatter(topology):
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology)
    shapes = {"a": (10, 3), "b": (5,), "c": (16, 8)}
    _, layout = tide_xla.shard({k: jnp.zeros(s) for k, s in shapes.items()}, mesh, "fsdp",
                               group_key=lambda path: "one")
    rng = np.random.default_rng(0)
    # rank-stamped small integers: every partial sum is exact in fp32
    grads = {k: jnp.asarray(rng.integers(-64, 64, (8, *s)), jnp.bfloat16)
             for k, s in shapes.items()}

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        tide = tide_xla.unpack_grads(tide_xla.reduce_scatter(g, layout), layout)

        def ref(x, leaf):
            pad = [(0, 8 * leaf.rows - leaf.shape[0])] + [(0, 0)] * (x.ndim - 1)
            return jax.lax.psum_scatter(jnp.pad(x.astype(jnp.float32), pad), "fsdp",
                                        scatter_dimension=0, tiled=True)
        return tide, jax.tree.map(ref, g, jax.tree.unflatten(layout.treedef, layout.leaves))

    spec = jax.tree.map(lambda _: P("fsdp"), grads)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
    tide, ref = fn(grads)
    for k in shapes:
        np.testing.assert_array_equal(np.asarray(tide[k]).view(np.uint32),
                                      np.asarray(ref[k]).view(np.uint32), err_msg=k)


def test_fp32_accumulation_in_place_through_donation():
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(2, 4))
    shapes = {"a": (10, 3), "c": (16, 8)}
    _, layout = tide_xla.shard({k: jnp.zeros(s) for k, s in shapes.items()}, mesh, "fsdp",
                               group_key=lambda path: "one")
    grads = {k: jnp.ones((8, *s), jnp.bfloat16) for k, s in shapes.items()}
    spec = jax.tree.map(lambda _: P("fsdp"), grads)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def accumulate(acc, g):
        def local(acc, g):
            return tide_xla.reduce_scatter(jax.tree.map(lambda x: x[0], g), layout,
                                           accumulate=acc)
        return jax.shard_map(local, mesh=mesh, in_specs=([P("fsdp")], spec),
                             out_specs=[P("fsdp")])(acc, g)

    acc = tide_xla.zeros_packed(layout)
    ptrs = [s.data.unsafe_buffer_pointer() for s in acc[0].addressable_shards]
    for _ in range(3):
        acc = accumulate(acc, grads)
    assert [s.data.unsafe_buffer_pointer() for s in acc[0].addressable_shards] == ptrs
    got = np.asarray(acc[0]).reshape(8, -1)
    e_a = 2 * 3  # rank r's rows of "a": R = 2 rows of 3, valid on ranks 0..4 (D = 10)
    for r in range(8):
        valid = min(2, max(0, 10 - 2 * r))
        np.testing.assert_array_equal(got[r, : valid * 3], 24.0)   # 3 calls x 8 ranks x 1.0
        np.testing.assert_array_equal(got[r, valid * 3: e_a], 0.0)  # FSDP2 padding rows
        np.testing.assert_array_equal(got[r, e_a:], 24.0)


def test_grads_through_a_scan_body():
    """The gather call site runs 3 times in a scan and TIDE-RS 3 times in its transpose."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(4, 2))
    w = jax.random.normal(jax.random.key(3), (12, 4))
    sharded, layout = tide_xla.shard({"w": w}, mesh, "fsdp")
    xs = jax.random.normal(jax.random.key(4), (8, 3, 4))  # per device, per step

    def local(s, x):
        def loss(s):
            def body(c, xi):
                full = tide_xla.gather(s, layout)["w"].astype(jnp.float32)
                return c + jnp.sum(jnp.tanh(full @ xi[0])), None
            c0 = jax.lax.pcast(jnp.float32(0), ("fsdp",), to="varying")
            return jax.lax.scan(body, c0, x[0])[0]
        return jax.grad(loss)(s)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs, P("fsdp")),
                               out_specs=layout.specs))
    got = np.asarray(layout.unshard(fn(sharded, xs[:, :, None]))["w"])

    def ref_one(x):  # one device's loss on bf16 parameters, as TIDE computes it
        wb = w.astype(jnp.bfloat16)
        return jax.grad(lambda p: sum(jnp.sum(jnp.tanh(p.astype(jnp.float32) @ x[i]))
                                      for i in range(3)))(wb).astype(jnp.float32)
    want = np.asarray(jnp.sum(jax.vmap(ref_one)(xs), 0))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("mesh_shape,topology", [((8,), (2, 4)), ((4, 2), (2, 2))])
def test_train_step_pulling_across_nodes_equals_one_node_bitwise(mesh_shape, topology):
    """fp32 shards on several nodes: the forward gather pulls into XLA's results
    (copy_out_bytes 0, [Note: pull landing across nodes] in csrc/program/ag_program.cc), and
    two SGD steps (gather, loss, TIDE-RS of the bf16 gradients, update) on integer data end bit
    for bit where the one-node steps and numpy end; the loss (built from the gathered values) too."""
    names = ("fsdp",) if len(mesh_shape) == 1 else ("fsdp", "data")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), names)
    n = mesh_shape[0]
    shapes = {"a": (10, 3), "b": (5,), "c": (16, 8), "e": (1, 7)}
    rng = np.random.default_rng(11)
    w0 = {k: rng.integers(-16, 16, s).astype(np.float32) for k, s in shapes.items()}
    xs = {k: rng.integers(-4, 4, (8, *s)).astype(np.float32) for k, s in shapes.items()}  # per device
    batch = P(mesh.axis_names)

    def run(topo):
        tide_xla.init(mesh, "fsdp", topology=topo)
        sharded, layout = tide_xla.shard({k: jnp.asarray(v) for k, v in w0.items()}, mesh, "fsdp",
                                         group_key=lambda path: "one")
        assert len(layout.groups) == 1
        assert tide_xla.copy_out_bytes(layout) == {g.name: 0 for g in layout.groups}

        def local(s, x):
            def loss(s):
                full = tide_xla.gather(s, layout)
                return sum(jnp.sum(full[k].astype(jnp.float32) * x[k][0]) for k in shapes)
            value, g = jax.value_and_grad(loss)(s)
            return jax.tree.map(lambda p, d: p - 0.5 * d, s, g), value[None]

        step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs, {k: batch for k in shapes}),
                                     out_specs=(layout.specs, batch)))
        x = {k: jnp.asarray(v) for k, v in xs.items()}
        losses = []
        for _ in range(2):
            sharded, value = step(sharded, x)
            losses.append(np.asarray(value))
        return {k: np.asarray(v) for k, v in layout.unshard(sharded).items()}, losses

    got, got_loss = run(topology)
    one, one_loss = run((1, n))
    w, want_loss = dict(w0), []
    for _ in range(2):  # numpy: every product and sum is a small integer (exact in fp32)
        want_loss.append(np.stack([sum(np.sum(w[k] * xs[k][d]) for k in shapes) for d in range(8)]))
        w = {k: w[k] - 0.5 * xs[k].sum(0) for k in shapes}
    for k in shapes:
        np.testing.assert_array_equal(got[k].view(np.uint32), one[k].view(np.uint32), err_msg=k)
        np.testing.assert_array_equal(got[k].view(np.uint32), w[k].view(np.uint32), err_msg=k)
    for a, b, c in zip(got_loss, one_loss, want_loss):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
