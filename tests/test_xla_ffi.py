"""tide_xla._ffi: the extension loads on this jaxlib, registers, and fails cleanly.

Run with 8 host devices: XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402
from tide_xla import _ffi  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (XLA_FLAGS)")


def mesh_1d(order=None):
    devs = np.array(jax.devices()[:8])
    return Mesh(devs if order is None else devs[list(order)], ("fsdp",))


def test_extension_loads_on_installed_jaxlib():
    import jaxlib
    assert tuple(int(v) for v in jaxlib.__version__.split(".")[:2]) >= (0, 11)
    assert _ffi.ffi_api_version == (0, 4)  # the vendored jaxlib 0.11.2 headers
    regs = _ffi.registrations()
    targets = {"tide_all_gather", "tide_reduce_scatter", "tide_all_gather_virtual",
               "tide_reduce_scatter_virtual"}
    assert set(regs["cpu"]) == targets
    if _ffi.built_with_cuda:
        assert set(regs["CUDA"]) == targets
    tide_xla.init(mesh_1d(), "fsdp")  # registers every platform without error


def test_import_tide_xla_does_not_import_torch():
    code = ("import sys; sys.modules['torch'] = None; import tide_xla; "
            "import tide_xla.gather, tide_xla.sharding; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def _gather_a(layout):
    def f(s):
        return tide_xla.gather(s, layout)["a"]
    return f


def test_device_that_skips_the_call_times_out_naming_it():
    mesh = mesh_1d()
    tide_xla.init(mesh, "fsdp", timeout_s=1.0)
    shards, layout = tide_xla.shard({"a": jnp.ones((16, 4))}, mesh, "fsdp")
    gather = _gather_a(layout)

    def f(s):
        skip = jax.lax.axis_index("fsdp") == 5
        return jax.lax.cond(skip, lambda s: jnp.zeros((16, 4), jnp.bfloat16), gather, s)

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(layout.specs,), out_specs=P("fsdp"),
                               check_vma=False))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(fn(shards))
    msg = str(info.value)
    assert "DEADLINE_EXCEEDED" in msg or "Deadline" in msg, msg
    assert "ranks [5]" in msg, msg
    tide_xla.init(mesh, "fsdp")  # restore the default timeout for later tests


def test_rank_comes_from_the_device_table_not_the_ordinal():
    """A reversed mesh: device id 7 is rank 0. The table says so; the ordinal is only a key."""
    mesh = mesh_1d(order=range(7, -1, -1))
    ctx = tide_xla.init(mesh, "fsdp")
    table = np.asarray(ctx.device_table).reshape(-1, 5)  # (process, id, local, group, rank)
    assert table[0].tolist() == [0, 7, 7, 0, 0] and table[7].tolist() == [0, 0, 0, 0, 7]


def test_handler_rejects_a_shard_that_is_not_padded_dim0():
    """The C++ boundary checks shapes itself: a bad call is INVALID_ARGUMENT naming the rule."""
    from tide_xla.all_gather import AllGatherPrimitive
    mesh = mesh_1d()
    ctx = tide_xla.init(mesh, "fsdp", topology=(2, 4))

    def local(x):  # local shard (2, 4) but dims0 claims D = 40 -> R_p should be 5
        return AllGatherPrimitive.bind(ctx, [x], [40], jnp.bfloat16)[0][None]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"),), out_specs=P("fsdp"),
                               check_vma=False))
    with pytest.raises(Exception, match=r"INVALID_ARGUMENT.*R_p = ceil\(D_p/N\)"):
        jax.block_until_ready(fn(jnp.ones((16, 4), jnp.bfloat16)))


def test_mesh_with_the_same_shape_but_other_devices_is_caught_at_run_time():
    """Same axis names and sizes, devices in another order: only the device table can tell."""
    mesh_a, mesh_b = mesh_1d(), mesh_1d(order=[1, 0, 2, 3, 4, 5, 6, 7])
    tide_xla.init(mesh_a, "fsdp")
    _, layout = tide_xla.shard({"a": jnp.ones((16, 4))}, mesh_a, "fsdp")
    shards = {"a": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh_b, P("fsdp")))}
    fn = jax.jit(jax.shard_map(lambda s: tide_xla.gather(s, layout)["a"][None], mesh=mesh_b,
                               in_specs=(layout.specs,), out_specs=P("fsdp")))
    # Devices 0 and 1 swapped places; either may be the first to report (thread timing), and
    # each names itself, its rank in init()'s mesh and the other index it has in this shard_map.
    with pytest.raises(Exception, match=r"INVALID_ARGUMENT.*mesh mismatch: device (0 is rank 0|1 is rank 1) "
                                        r"of group 0 in the mesh given to tide_xla.init\(\), but has index "
                                        r"(1|0) along the FSDP axis") as err:
        jax.block_until_ready(fn(shards))
    m = re.search(r"device (\d) is rank \d .* has index (\d)", str(err.value))
    assert m and m.group(1) != m.group(2), str(err.value)
