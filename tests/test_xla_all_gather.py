"""TIDE-AG through XLA FFI equals jax.lax.all_gather (2 x 4 and 4 x 2 virtual clusters, and an
fsdp x data mesh); with fp32 shards it pulls into XLA's results on one node and across nodes (bit
for bit the one-node gather, one- and two-sided rails)."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402
from tide_xla import _ffi  # noqa: E402

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (XLA_FLAGS)"),
    pytest.mark.skipif(not _ffi.executor_available("cpu"), reason=_ffi.executor_description("cpu")),
]

SHAPES = {"a": (10, 3), "b": (5,), "c": (16, 8), "d": (3, 2, 2), "e": (1, 7)}


def params(seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {k: jax.random.normal(key, s, dtype) for key, (k, s) in zip(keys, SHAPES.items())}


def gathered_copies(mesh, axis, layout, sharded, use_tide, check_vma=True):
    """Every device's gathered tree, stacked on a new leading axis (one copy per device)."""
    names = mesh.axis_names

    def local(s):
        if use_tide:
            full = tide_xla.gather(s, layout)
        else:
            full = jax.tree.map(lambda x, leaf: jax.lax.all_gather(
                x.astype(layout.ag_dtype), axis, tiled=True)[: leaf.shape[0]],
                s, jax.tree.unflatten(layout.treedef, layout.leaves))
        return jax.tree.map(lambda x: x[None], full)

    out_spec = jax.tree.map(lambda _: P(names), layout.specs)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs,), out_specs=out_spec,
                               check_vma=check_vma))
    return jax.tree.map(np.asarray, fn(sharded))


@pytest.mark.parametrize("topology", [(2, 4), (4, 2)])
@pytest.mark.parametrize("shard_dtype", [jnp.bfloat16, jnp.float32])
def test_gather_equals_all_gather(topology, shard_dtype):
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology)
    sharded, layout = tide_xla.shard(params(), mesh, "fsdp", shard_dtype=shard_dtype,
                                     group_key=lambda path: "one")  # one call, P = 5
    got = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
    want = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=False)
    for k in SHAPES:
        assert got[k].dtype == jnp.bfloat16 and got[k].shape == (8, *SHAPES[k])
        np.testing.assert_array_equal(got[k].view(np.uint16), want[k].view(np.uint16), err_msg=k)


def test_gather_on_2d_mesh_fsdp_x_data():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "data"))
    tide_xla.init(mesh, "fsdp", topology=(2, 2))
    sharded, layout = tide_xla.shard(params(1), mesh, "fsdp")  # groups a..e, 5 calls
    got = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
    want = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=False)
    for k in SHAPES:
        np.testing.assert_array_equal(got[k].view(np.uint16), want[k].view(np.uint16), err_msg=k)


def test_gather_under_scan_replays_the_call_site():
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(2, 4))
    sharded, layout = tide_xla.shard(params(2), mesh, "fsdp")

    def local(s):
        def body(carry, i):
            full = tide_xla.gather(jax.tree.map(lambda x: x * (i + 1), s), layout)
            return carry + full["c"].astype(jnp.float32), None
        out, _ = jax.lax.scan(body, jnp.zeros(SHAPES["c"], jnp.float32), jnp.arange(3.0))
        return out[None]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs,),
                               out_specs=P("fsdp"), check_vma=False))
    got = np.asarray(fn(sharded))
    c = np.asarray(layout.unshard(sharded)["c"])
    want = sum(np.asarray(jnp.asarray(c * (i + 1), jnp.bfloat16), np.float32) for i in range(3))
    for r in range(8):
        np.testing.assert_allclose(got[r], want, rtol=0, atol=0)


def test_slot_reuse_mode_gives_the_same_bytes():
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharded, layout = tide_xla.shard(params(3), mesh, "fsdp", group_key=lambda path: "one")
    tide_xla.init(mesh, "fsdp", topology=(4, 2), mode="slot_reuse")
    got = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
    tide_xla.init(mesh, "fsdp", topology=(4, 2), mode="in_place")
    want = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
    for k in SHAPES:
        np.testing.assert_array_equal(got[k].view(np.uint16), want[k].view(np.uint16), err_msg=k)


def test_linen_variables_round_trip_and_apply():
    from flax import linen as nn
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(2, 4))
    model = nn.Sequential([nn.Dense(12), nn.relu, nn.Dense(5)])
    x = jnp.ones((8, 7))
    variables = model.init(jax.random.key(0), x)
    sharded, layout = tide_xla.shard(variables, mesh, "fsdp")

    def local(s, x):
        return model.apply(tide_xla.gather(s, layout), x.astype(jnp.bfloat16))

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs, P("fsdp")),
                               out_specs=P("fsdp")))
    want = model.apply(jax.tree.map(lambda v: v.astype(jnp.bfloat16), variables),
                       x.astype(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(fn(sharded, x), np.float32),
                               np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("topology,shard_dtype,pulls", [
    ((1, 8), jnp.float32, True),    # one node, fp32 shards: TIDE-AG pulls into XLA's results
    ((2, 4), jnp.float32, True),    # two nodes, fp32 shards: pulls of the peers' round areas too
    ((1, 8), jnp.bfloat16, False),  # bf16 shards: no stage to pull from
    ((2, 4), jnp.bfloat16, False),  # ... on any number of nodes: one copy-out
])
def test_copy_out_bytes_says_where_the_landing_copy_remains(topology, shard_dtype, pulls):
    """tide_xla.copy_out_bytes: 0 for a group that lands in XLA's results by pulling, else its
    unsharded parameters in bf16; the gathers equal jax.lax.all_gather either way."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology)
    sharded, layout = tide_xla.shard(params(2, shard_dtype), mesh, "fsdp", shard_dtype=shard_dtype)
    out = tide_xla.copy_out_bytes(layout)
    assert set(out) == {g.name for g in layout.groups}
    for g in layout.groups:
        full = sum(int(np.prod(layout.leaves[i].shape)) for i in g.leaves) * 2
        assert out[g.name] == (0 if pulls else full), g.name
    got = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
    want = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=False)
    for k in SHAPES:
        assert np.array_equal(np.asarray(got[k]).view(np.uint16), np.asarray(want[k]).view(np.uint16)), k


def int_params(seed, dtype=jnp.float32):
    """Small integers: exact in bf16, so every cast and gather is bit-comparable."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.integers(-64, 64, s), dtype) for k, s in SHAPES.items()}


def two_groups(path):
    return "ac" if jax.tree_util.keystr(path) in ("['a']", "['c']") else "bde"


@pytest.mark.parametrize("mesh_shape,topology", [((8,), (2, 4)), ((8,), (4, 2)), ((8,), (8, 1)),
                                                 ((4, 2), (2, 2))])  # fsdp x data: 2 groups of 2 x 2
def test_pull_landing_across_nodes_equals_one_node_bitwise(mesh_shape, topology):
    """fp32 shards and a bf16 AG on several nodes ([Note: pull landing across nodes] in
    csrc/program/ag_program.cc): the handlers' plan pulls (group_plan's pull_landing,
    copy_out_bytes 0), and XLA's results hold, bit for bit, what one node gathers and what
    jax.lax.all_gather gives, for integer data over two calls."""
    from tide_xla.context import MODES, context_for
    names = ("fsdp",) if len(mesh_shape) == 1 else ("fsdp", "data")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), names)
    n = mesh_shape[0]
    assert topology[0] > 1 and topology[0] * topology[1] == n
    for seed in (7, 8):  # a second call of the same states: the credits of call 1 released the stage
        full = int_params(seed)
        got = {}
        for topo in ((1, n), topology):
            tide_xla.init(mesh, "fsdp", topology=topo)
            sharded, layout = tide_xla.shard(full, mesh, "fsdp", group_key=two_groups)
            assert len(layout.groups) == 2 and layout.shard_dtype == jnp.float32
            ctx = context_for(mesh, "fsdp")
            for g in layout.groups:
                info = _ffi.group_plan("tide_all_gather", [list(layout.leaves[i].shape) for i in g.leaves],
                                       "float32", "bfloat16", ctx.nodes, ctx.gpus_per_node, MODES[ctx.mode])
                assert info["pull_landing"], (topo, g.name)
            assert tide_xla.copy_out_bytes(layout) == {g.name: 0 for g in layout.groups}
            got[topo] = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
        want = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=False)
        for k, shape in SHAPES.items():
            bits = np.asarray(got[topology][k]).view(np.uint16)
            assert got[topology][k].shape == (8, *shape)
            np.testing.assert_array_equal(bits, np.asarray(got[(1, n)][k]).view(np.uint16), err_msg=k)
            np.testing.assert_array_equal(bits, np.asarray(want[k]).view(np.uint16), err_msg=k)
            ref = np.asarray(full[k].astype(jnp.bfloat16)).view(np.uint16)
            np.testing.assert_array_equal(bits, np.broadcast_to(ref, bits.shape), err_msg=k)


def test_pull_landing_across_nodes_on_two_sided_rails(monkeypatch):
    """The XLA:CPU executor on two-sided rails (TIDE_EXEC_OPTIONS=rails=two_sided: the Bruck
    rounds lowered to SEND/RECV, as on CUDA across processes): the pulled gather on 2 x 4 is
    still bit for bit jax.lax.all_gather's."""
    monkeypatch.setenv("TIDE_EXEC_OPTIONS", "rails=two_sided")
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(2, 4))  # fresh states: their executors read the option
    try:
        sharded, layout = tide_xla.shard(int_params(9), mesh, "fsdp", group_key=two_groups)
        assert tide_xla.copy_out_bytes(layout) == {g.name: 0 for g in layout.groups}
        got = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
        want = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=False)
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint16),
                                          np.asarray(want[k]).view(np.uint16), err_msg=k)
    finally:
        tide_xla.release(mesh)  # no later test runs on these two-sided states


@pytest.mark.parametrize("rails", ["one_sided", "two_sided"])
@pytest.mark.parametrize("topology", [(1, 8), (2, 4), (4, 2)])
def test_pulled_gather_state_holds_only_what_its_programs_touch(topology, rails, monkeypatch):
    """A pulled group's TIDE-AG state ([Note: pulled arena] in tide/plan.h): its arena holds the
    stage its pull programs address (the program index's region ends) and exactly their counters
    on the rails its executor runs (TIDE_EXEC_OPTIONS=rails=two_sided: the lowering's too), no
    ring slot; group_plan reports that layout, the memory model the same bytes (one-sided), and
    live_states counts exactly that per rank once the state exists."""
    import tide
    from tide import _core
    from tide_xla.context import MODES, context_for
    if rails == "two_sided":
        monkeypatch.setenv("TIDE_EXEC_OPTIONS", "rails=two_sided")
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=topology)  # fresh states: their executors read the option
    try:
        sharded, layout = tide_xla.shard(int_params(12), mesh, "fsdp", group_key=lambda path: "one")
        ctx = context_for(mesh, "fsdp")
        shapes = [list(layout.leaves[i].shape) for i in layout.groups[0].leaves]
        info = _ffi.group_plan("tide_all_gather", shapes, "float32", "bfloat16", ctx.nodes, ctx.gpus_per_node,
                               MODES[ctx.mode])
        sig = tide.GroupSignature(shapes=shapes, ag_dtype="bfloat16", grad_dtype="bfloat16", shard_dtype="float32",
                                  names=[f"parameter {p}" for p in range(len(shapes))])
        plan = tide.plan(sig, tide.Topology(*topology), mode=ctx.mode)
        assert plan.hash == info["hash"] and info["pull_landing"] and info["rails"] == rails
        pull = _core.build_ag_programs(plan, resident=False, pull_landing=True, with_expects=False)
        if rails == "two_sided":
            pull = pull.lowered()
        stage = max(pull.arena_ends(r)["stage"] for r in range(8))
        assert all(set(pull.arena_ends(r)) == {"stage"} for r in range(8))
        n = pull.num_counters
        assert n == _core.program_counters(plan, "all_gather", rails)  # two-sided: the lowered programs'
        counters = -(-stage // 4096) * 4096
        assert info["arena"] == {"stage": (0, stage), "counters": (counters, 8 * n)}
        assert info["arena_bytes"] == counters + 8 * n
        n1 = _core.program_counters(plan, "all_gather", "one_sided")
        assert plan.memory()["pull_arena_bytes"] == info["arena_bytes"] - 8 * (n - n1)
        before = tide_xla.live_states()
        got = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
        after = tide_xla.live_states()
        assert after["group_states"] == before["group_states"] + 1
        assert after["arena_bytes"] - before["arena_bytes"] == 8 * info["arena_bytes"]  # one arena per rank
        want = gathered_copies(mesh, "fsdp", layout, sharded, use_tide=False)
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint16),
                                          np.asarray(want[k]).view(np.uint16), err_msg=k)
    finally:
        tide_xla.release(mesh)  # no later test runs on these states


def test_handler_stats_count_every_devices_call():
    """_ffi.handler_stats: one TIDE-AG call per group and device, with its host time; the reset
    starts from zero (the Flax example reports them per step)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    tide_xla.init(mesh, "fsdp", topology=(2, 4))
    sharded, layout = tide_xla.shard(params(3), mesh, "fsdp")
    gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)  # compiles and creates the states
    _ffi.reset_handler_stats()
    assert _ffi.handler_stats() == {"tide_all_gather": (0, 0), "tide_reduce_scatter": (0, 0)}
    gathered_copies(mesh, "fsdp", layout, sharded, use_tide=True)
    calls, ns = _ffi.handler_stats()["tide_all_gather"]
    assert calls == 8 * len(layout.groups) and ns > 0
    assert _ffi.handler_stats()["tide_reduce_scatter"] == (0, 0)
