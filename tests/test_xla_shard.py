"""tide_xla.shard / layout / input validation (no collective runs here)."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (XLA_FLAGS)")


def mesh(shape=(8,), names=("fsdp",)):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def test_padding_as_fsdp2_pads():
    m = mesh()
    params = {"w": jnp.arange(10 * 3, dtype=jnp.float32).reshape(10, 3), "b": jnp.ones((5,))}
    sharded, layout = tide_xla.shard(params, m, "fsdp")
    assert sharded["w"].shape == (16, 3) and sharded["b"].shape == (8,)  # N * ceil(D/N)
    assert [leaf.rows for leaf in layout.leaves] == [1, 2]  # sorted keys: b, w
    assert sharded["w"].dtype == jnp.float32
    assert sharded["w"].sharding.spec == P("fsdp")
    np.testing.assert_array_equal(np.asarray(sharded["w"])[10:], 0)  # zero padding rows
    back = layout.unshard(sharded)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(params["w"]))


def test_groups_per_layer_and_cap():
    m = mesh()
    params = {"blocks": [{"q": jnp.ones((8, 8)), "k": jnp.ones((8, 8))} for _ in range(3)],
              "embed": jnp.ones((16, 8)), "head": {"w": jnp.ones((8, 16))}}
    _, layout = tide_xla.shard(params, m, "fsdp")
    names = sorted(g.name for g in layout.groups)
    assert names == ["blocks/0", "blocks/1", "blocks/2", "embed", "head"]
    many = {f"p{i:03d}": jnp.ones((8,)) for i in range(300)}
    _, layout = tide_xla.shard(many, m, "fsdp", group_key=lambda path: "all")
    assert [len(g.leaves) for g in layout.groups] == [256, 44]


def test_flax_nnx_state_and_linen_variables():
    from flax import linen as nn, nnx
    m = mesh()

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(12, 12, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.out = nnx.Linear(12, 3, rngs=rngs)

    _, state = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    sharded, layout = tide_xla.shard(state, m, "fsdp")
    assert sorted(g.name for g in layout.groups) == ["blocks/0", "blocks/1", "out"]
    assert jax.tree.structure(sharded) == jax.tree.structure(state)

    variables = nn.Dense(5).init(jax.random.key(0), jnp.ones((1, 7)))
    sharded, layout = tide_xla.shard(variables, m, "fsdp")
    assert sharded["params"]["kernel"].shape == (8, 5)


def test_non_dim0_sharding_is_rejected():
    m = mesh()
    x = jax.device_put(jnp.ones((4, 16)), NamedSharding(m, P(None, "fsdp")))
    with pytest.raises(ValueError, match="sharded on dim 1.*dim 0 only"):
        tide_xla.shard({"x": x}, m, "fsdp")


def test_mesh_mismatch_is_rejected():
    m1 = mesh()
    m2 = mesh((4, 2), ("fsdp", "data"))
    x = jax.device_put(jnp.ones((16, 4)), NamedSharding(m2, P("fsdp")))
    with pytest.raises(ValueError, match="mesh mismatch"):
        tide_xla.shard({"x": x}, m1, "fsdp")
    with pytest.raises(ValueError, match="not an axis"):
        tide_xla.shard({"x": jnp.ones((8,))}, m1, "data")
    # gather inside a shard_map over another mesh
    tide_xla.init(m1, "fsdp")
    sharded, layout = tide_xla.shard({"x": jnp.ones((16, 4))}, m1, "fsdp")
    f = jax.shard_map(lambda s: tide_xla.gather(s, layout)["x"], mesh=m2,
                      in_specs=(P("fsdp"),), out_specs=P())
    with pytest.raises(ValueError, match="mesh mismatch"):
        jax.eval_shape(f, {"x": jax.ShapeDtypeStruct((16, 4), jnp.float32)})


def test_gather_outside_shard_map_and_without_init():
    m = mesh()
    sharded, layout = tide_xla.shard({"x": jnp.ones((16, 4))}, m, "fsdp")
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        tide_xla.gather(sharded, layout)
    m3 = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    sharded, layout = tide_xla.shard({"x": jnp.ones((16, 4))}, m3, "fsdp")
    f = jax.shard_map(lambda s: tide_xla.gather(s, layout)["x"], mesh=m3,
                      in_specs=(layout.specs,), out_specs=P())
    with pytest.raises(ValueError, match="call tide_xla.init"):
        jax.eval_shape(f, sharded)


def test_scalar_leaves_and_bad_topology_are_rejected():
    m = mesh()
    with pytest.raises(ValueError, match="dim 0"):
        tide_xla.shard({"s": jnp.ones(())}, m, "fsdp")
    with pytest.raises(ValueError, match="3x2"):
        tide_xla.init(m, "fsdp", topology=(3, 2))


def test_unsupported_cast_is_rejected():
    with pytest.raises(ValueError, match="casts float32 shards to bfloat16"):
        tide_xla.shard({"w": jnp.ones((8, 2))}, mesh(), "fsdp", shard_dtype=jnp.bfloat16,
                       ag_dtype=jnp.float32)


def test_a_leaf_of_another_dtype_is_refused_not_cast():
    m = mesh()
    tide_xla.init(m, "fsdp")
    params = {"w": jnp.ones((10, 3), jnp.float32), "b": jnp.ones((5,), jnp.float32)}
    sharded, layout = tide_xla.shard(params, m, "fsdp")  # fp32 shards, bf16 gather

    def run(fn, specs, tree):
        return jax.jit(jax.shard_map(fn, mesh=m, in_specs=(specs,), out_specs=P(), check_vma=False))(tree)

    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), sharded)
    with pytest.raises(ValueError, match=r"tide_xla.gather: leaf \[.b.\] has dtype bfloat16, expected the "
                                         r"layout's shard_dtype float32 .*never rounds"):
        run(lambda s: jnp.sum(tide_xla.gather(s, layout)["w"].astype(jnp.float32)), layout.specs, as_bf16)
    full = {"w": jnp.ones((10, 3), jnp.float32), "b": jnp.ones((5,), jnp.float32)}  # grads in fp32
    with pytest.raises(ValueError, match=r"tide_xla.reduce_scatter: leaf \[.b.\] has dtype float32, expected "
                                         r"the layout's ag_dtype bfloat16"):
        run(lambda g: jnp.sum(tide_xla.reduce_scatter(g, layout)[0]), {"w": P(), "b": P()}, full)


# ---- bad input named at the call (issue 45) -------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(shard_dtype=jnp.int8, ag_dtype=jnp.int8), r"shard_dtype int8 is not supported: TIDE's shards"),
    (dict(shard_dtype=jnp.int32, ag_dtype=jnp.int32), r"shard_dtype int32 is not supported"),
    (dict(ag_dtype=jnp.uint8), r"ag_dtype uint8 is not supported"),
    (dict(shard_dtype=jnp.float64, ag_dtype=jnp.float64), r"shard_dtype float64 is not supported"),
    (dict(ag_dtype=jnp.bool_), r"ag_dtype bool is not supported"),
    (dict(ag_dtype=jnp.complex64), r"ag_dtype complex64 is not supported"),
    (dict(shard_dtype="fp99"), r"shard_dtype='fp99' is not a dtype"),
])
def test_non_float_shard_and_gather_dtypes_are_refused_up_front(kw, match):
    """int8 shards used to be accepted, 300.0 became 44, and gather failed only at run time."""
    with pytest.raises(ValueError, match=match):
        tide_xla.shard({"w": np.full((8, 2), 300.0, np.float32)}, mesh(), "fsdp", **kw)


def test_float16_shards_are_still_taken():
    sharded, layout = tide_xla.shard({"w": np.ones((8, 2), np.float16)}, mesh(), "fsdp",
                                     shard_dtype=jnp.float16, ag_dtype=jnp.float16)
    assert sharded["w"].dtype == jnp.float16 and layout.ag_dtype == jnp.float16


@pytest.mark.parametrize("leaf,match", [
    (np.array([[1, "a"]] * 8, dtype=object), r"leaf \['x'\]\['bad'\] has dtype object"),
    (np.ones((8, 2), np.int64), r"leaf \['x'\]\['bad'\] has dtype int64"),
    (np.ones((8,), np.bool_), r"leaf \['x'\]\['bad'\] has dtype bool"),
    (np.ones((8,), np.complex64), r"leaf \['x'\]\['bad'\] has dtype complex64"),
    (np.array([b"ab"] * 8), r"leaf \['x'\]\['bad'\] has dtype \|S2"),
])
def test_a_non_float_leaf_is_named(leaf, match):
    params = {"x": {"ok": np.ones((8, 2), np.float32), "bad": leaf}}
    with pytest.raises(ValueError, match=match + r"; only floating parameters are sharded"):
        tide_xla.shard(params, mesh(), "fsdp")


def test_a_float64_leaf_without_x64_warns_naming_it():
    """With x64 off JAX holds float64 as float32: shard used to round it silently."""
    assert not jax.config.jax_enable_x64
    params = {"a": np.ones((8, 2), np.float32), "b": {"c": np.full((9,), 0.1)}}
    with pytest.warns(UserWarning, match=r"shard: leaf \['b'\]\['c'\] \(float64\) rounds into "
                                         r"shard_dtype float32; jax_enable_x64 is off"):
        sharded, layout = tide_xla.shard(params, mesh(), "fsdp")
    assert tide_xla.unshard(sharded, layout)["b"]["c"].dtype == jnp.float32
    # fp32 leaves into bf16 shards are the caller's explicit choice; fp32, bf16 and float8 leaves
    # into fp32 master shards lose nothing: no warning.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tide_xla.shard({"a": np.ones((8, 2), np.float32)}, mesh(), "fsdp",
                       shard_dtype=jnp.bfloat16, ag_dtype=jnp.bfloat16)
        tide_xla.shard({"a": np.ones((8, 2), np.float32), "b": jnp.ones((8,), jnp.bfloat16),
                        "c": jnp.ones((8,), jnp.float8_e4m3fn)}, mesh(), "fsdp")


@pytest.mark.parametrize("kw,exc,match", [
    (dict(topology=(2.5, 2)), TypeError, r"topology: nodes must be an int, got 2\.5"),
    (dict(topology=(True, 8)), TypeError, r"topology: nodes must be an int, got True"),
    (dict(topology=("2", 4)), TypeError, r"topology: nodes must be an int, got '2'"),
    (dict(topology=(-2, -4)), ValueError, r"topology: nodes must be >= 1, got -2"),
    (dict(timeout_s=0), ValueError, r"init: timeout_s must be a number of seconds in \(0, 1e6\], got 0"),
    (dict(timeout_s=float("nan")), ValueError, r"timeout_s must be .*got nan"),
    (dict(timeout_s="60"), ValueError, r"timeout_s must be .*got '60'"),
    (dict(mode=["in_place"]), ValueError, r"init: mode must be one of .*got \['in_place'\]"),
])
def test_init_refuses_bad_argument_values_and_types(kw, exc, match):
    with pytest.raises(exc, match=match):
        tide_xla.init(mesh(), "fsdp", **kw)


@pytest.mark.parametrize("value", [0, 257, 2.0, True, "8"])
def test_shard_refuses_a_bad_max_group_params(value):
    with pytest.raises(ValueError, match=rf"max_group_params must be an int in \[1, 256\], got {value!r}"):
        tide_xla.shard({"w": np.ones((8, 2), np.float32)}, mesh(), "fsdp", max_group_params=value)


@pytest.mark.parametrize("value,exc", [("0.5", TypeError), (True, TypeError), (None, TypeError),
                                       (float("inf"), ValueError), (float("nan"), ValueError)])
def test_gather_and_reduce_scatter_name_a_bad_scale(value, exc):
    m = mesh()
    tide_xla.init(m, "fsdp")
    sharded, layout = tide_xla.shard({"w": jnp.ones((16, 4))}, m, "fsdp")
    with pytest.raises(exc, match=r"tide_xla.gather: grad_scale must be a finite number"):
        tide_xla.gather(sharded, layout, grad_scale=value)
    with pytest.raises(exc, match=r"tide_xla.reduce_scatter: scale must be a finite number"):
        tide_xla.reduce_scatter({"w": jnp.ones((16, 4), jnp.bfloat16)}, layout, scale=value)
