"""Checkpoints and export: tide_xla.unshard / shard round trips, and orbax-checkpoint save and
restore of the shards and the optax state across jax.distributed processes on XLA:CPU, restored
on the same and on other process and device counts (docs/xla.md, "Checkpoints and export")."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, Mesh, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402
from xla_mp_helpers import launch  # noqa: E402

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (XLA_FLAGS)")


def _bits(x):
    return np.asarray(x).tobytes()


@needs8
@pytest.mark.parametrize("explicit", [False, True])
def test_unshard_of_shard_is_the_tree_bitwise(explicit):
    """Padded rows dropped and the dtype each leaf had (bf16 stays bf16 through fp32 shards);
    `shard` takes unshard's replicated tree back to the same shards; ShapeDtypeStruct leaves give
    the shards' shapes and shardings (a restore target) without arrays."""
    devs = jax.devices()[:8]
    mesh = (jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=devs) if explicit
            else Mesh(np.array(devs), ("fsdp",)))
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((37, 3)).astype(np.float32), "blocks": [
        {"q": jnp.asarray(rng.standard_normal((9, 4)), jnp.bfloat16), "b": rng.standard_normal(8).astype(np.float32)}]}
    shards, layout = tide_xla.shard(params, mesh, "fsdp")
    back = tide_xla.unshard(shards, layout)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert b.dtype == a.dtype and b.shape == a.shape and b.sharding.spec == P()
        assert _bits(a) == _bits(b)
    again, _ = tide_xla.shard(back, mesh, "fsdp")
    for a, b in zip(jax.tree.leaves(shards), jax.tree.leaves(again)):
        assert _bits(a) == _bits(b) and b.sharding == a.sharding
    as_f32 = tide_xla.unshard(shards, layout, dtype=jnp.float32)
    assert {x.dtype for x in jax.tree.leaves(as_f32)} == {jnp.dtype(jnp.float32)}
    target, layout2 = tide_xla.shard(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
                                     mesh, "fsdp")
    for t, s in zip(jax.tree.leaves(target), jax.tree.leaves(shards)):
        assert isinstance(t, jax.ShapeDtypeStruct)
        assert (t.shape, t.dtype, t.sharding) == (s.shape, s.dtype, s.sharding)
    assert [l.rows for l in layout2.leaves] == [l.rows for l in layout.leaves]
    with pytest.raises(ValueError, match=r"unshard: leaf \['blocks'\]\[0\]\['q'\] has shape \(9, 4\), expected the layout's padded \(16, 4\)"):
        tide_xla.unshard(params, layout)


@pytest.fixture
def saved_41x8(tmp_path):
    """A checkpoint of {"a": (41, 8), "b": (5,), "c": [(37, 8)]} saved at N = 8 with TIDE's leaf
    shapes (the recipe: custom_metadata=tide_xla.checkpoint_metadata(layout))."""
    ocp = pytest.importorskip("orbax.checkpoint")
    rng = np.random.default_rng(5)
    params = {"a": rng.standard_normal((41, 8)).astype(np.float32), "b": np.ones(5, np.float32),
              "c": [rng.standard_normal((37, 8)).astype(np.float32)]}
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    shards, layout = tide_xla.shard(params, mesh, "fsdp")
    ckpt = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    ckpt.save(path, {"shards": shards}, custom_metadata=tide_xla.checkpoint_metadata(layout))
    ckpt.wait_until_finished()
    return ckpt, path, params


@needs8
@pytest.mark.parametrize("change,match", [
    # the two: more rows saved than the target has, another trailing dimension
    ({"a": (37, 8)}, r"leaf \['a'\] was saved with shape \(41, 8\), the layout's is \(37, 8\)"),
    ({"c": [(37, 9)]}, r"leaf \['c'\]\[0\] was saved with shape \(37, 8\), the layout's is \(37, 9\)"),
    # others of the same kind: fewer rows, another rank, another leaf set
    ({"a": (45, 8)}, r"leaf \['a'\] was saved with shape \(41, 8\), the layout's is \(45, 8\)"),
    ({"b": (5, 1)}, r"leaf \['b'\] was saved with shape \(5,\), the layout's is \(5, 1\)"),
    ({"d": (3,)}, r"leaf \['d'\] \(3,\) of the layout is not in the checkpoint"),
    ({"c": []}, r"the checkpoint has leaves the layout does not: \['c'\]\[0\]"),
])
def test_restore_of_another_models_checkpoint_names_the_leaf(saved_41x8, change, match):
    """Issue 45: with strict=False orbax truncated / zero-padded such leaves silently."""
    ckpt, path, params = saved_41x8
    shapes = {"a": (41, 8), "b": (5,), "c": [(37, 8)], **change}
    other = jax.tree.map(lambda s: np.zeros(s, np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple))
    mesh3 = Mesh(np.array(jax.devices()[:3]), ("fsdp",))
    target, layout = tide_xla.shard(other, mesh3, "fsdp")
    with pytest.raises(ValueError, match=r"tide_xla.check_checkpoint: " + match):
        tide_xla.restore(ckpt, path, {"shards": target}, layout)


@needs8
def test_restore_of_the_same_model_on_another_n_is_bitwise(saved_41x8):
    ckpt, path, params = saved_41x8
    mesh3 = Mesh(np.array(jax.devices()[:3]), ("fsdp",))
    target, layout = tide_xla.shard(jax.tree.map(np.zeros_like, params), mesh3, "fsdp")
    got = tide_xla.restore(ckpt, path, {"shards": target}, layout)
    back = tide_xla.unshard(got["shards"], layout)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert _bits(a) == _bits(b)


@needs8
def test_a_checkpoint_without_tide_shapes_is_not_restored_unchecked(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    shards, layout = tide_xla.shard({"a": np.ones((41, 8), np.float32)}, mesh, "fsdp")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "plain", {"shards": shards})
    ckpt.wait_until_finished()
    with pytest.raises(ValueError, match=r"the checkpoint has no tide_xla leaf shapes"):
        tide_xla.restore(ckpt, tmp_path / "plain", {"shards": shards}, layout)
    with pytest.raises(ValueError, match=r"version 7"):
        tide_xla.check_checkpoint({"tide_xla": {"version": 7, "leaves": {}}}, layout)


def _job(out_dir, ckpt_dir, processes, devices, case):
    env = dict(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               CKPT_DIR=str(ckpt_dir))
    res = launch(out_dir, processes, case, None, env, wait_s=90.0)
    for i, (rc, data, err) in res.items():
        assert rc == 0 and data is not None, f"{processes} x {devices}, process {i}: {err}"
    return res


def _merged(res, prefix):
    out = {}
    for _, data, _ in res.values():
        out.update({k: v for k, v in data.items() if k.startswith(prefix)})
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 processes x 4 devices train 2 steps and save; then their third step."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    res = _job(tmp_path_factory.mktemp("save"), ckpt, 2, 4, "ckpt_save")
    for _, data, _ in res.values():  # every process holds the same unsharded tree
        assert {k: v.tobytes() for k, v in data.items() if k.startswith("u/")} == \
               {k: v.tobytes() for k, v in res[0][1].items() if k.startswith("u/")}
    return ckpt, res


def test_orbax_restore_on_the_same_processes_is_bitwise_and_trains_on(tmp_path, saved):
    """Restored on 2 x 4 into other values: params, Adam's moments and count bitwise, and the next
    step's shards bitwise those of the run that saved."""
    ckpt, ref = saved
    res = _job(tmp_path, ckpt, 2, 4, "ckpt_restore")
    for prefix in ("u/", "next/"):
        a, b = _merged(ref, prefix), _merged(res, prefix)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), prefix


@pytest.mark.parametrize("processes,devices", [(1, 3), (4, 1)])
def test_orbax_restore_on_other_process_and_device_counts_is_bitwise(tmp_path, saved, processes, devices):
    """A checkpoint of N = 8 restored at N = 3 (one process, 3 devices: R_p = ceil(D_p/3), dim 0
    truncated or zero-padded by orbax) and at N = 4 (4 processes of 1 device): the unsharded
    params, moments and count are bitwise the saved ones, padding rows zero, and a step runs."""
    ckpt, ref = saved
    res = _job(tmp_path, ckpt, processes, devices, "ckpt_restore")
    a, b = _merged(ref, "u/"), _merged(res, "u/")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert _merged(res, "next/")


def test_checkpoint_example_restores_on_3_devices_bitwise(tmp_path):
    """examples/flax_checkpoint.py: 8 devices save, 3 devices restore bitwise, train on and export
    the original shapes."""
    import subprocess
    import sys
    from xla_mp_helpers import REPO
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "flax_checkpoint.py"), "--dir",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "restored on 3 devices from 8: parameters bitwise equal; Adam step count 3" in r.stdout
    export = np.load(tmp_path / "params.npz")
    assert {k: export[k].shape for k in export} == {
        "['layers'][0]['bias'].value": (37,), "['layers'][0]['kernel'].value": (13, 37),
        "['layers'][1]['bias'].value": (5,), "['layers'][1]['kernel'].value": (37, 5)}
