"""The XLA face's states have a lifetime (tide_xla/context.py [Note: context lifetime]).

On XLA:CPU with 8 host devices (one process): a training step (TIDE-AG forward, TIDE-RS backward)
builds the mesh's group states and their arenas; ``tide_xla.release`` frees them (live_states()
back to where it was), a re-init of the mesh releases the old context's states first, the context
manager releases on exit, and a jitted step run after the release raises naming tide_xla.release
instead of reaching freed memory (then runs again after init). Repeating init -> step -> release
keeps the live states, their arena bytes and the process RSS flat.
"""
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

ROWS, COLS = 1024, 256  # 1 MiB of fp32 per weight: arenas of a few MiB per step


def _mesh():
    return Mesh(np.array(jax.devices()[:8]), ("fsdp",))


def _step(mesh, topology=(2, 4)):
    """init, shard, and a jitted step: gathered forward, TIDE-RS gradients (one group)."""
    tide_xla.init(mesh, "fsdp", topology=topology)
    params = {"w": jnp.ones((ROWS, COLS), jnp.float32) / ROWS, "b": jnp.arange(COLS, dtype=jnp.float32)}
    shards, layout = tide_xla.shard(params, mesh, "fsdp", group_key=lambda path: "one")

    def local_loss(s, x):
        full = tide_xla.gather(s, layout)
        return jnp.sum((x @ full["w"] + full["b"]).astype(jnp.float32) ** 2)

    step = jax.jit(jax.shard_map(jax.grad(local_loss), mesh=mesh, in_specs=(layout.specs, P("fsdp")),
                                 out_specs=layout.specs))
    x = jnp.ones((8 * 2, ROWS), jnp.bfloat16) / 7
    return lambda: jax.block_until_ready(step(shards, x))


@pytest.fixture(autouse=True)
def _released_meshes():
    """Each test starts with no context: states earlier tests of this process left on the same
    devices would otherwise be shared with (and counted against) this test's."""
    from tide_xla import context
    for mesh, axis in list(context._CONTEXTS):
        tide_xla.release(mesh, axis)
    yield


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_release_frees_the_states_and_a_later_call_raises():
    mesh = _mesh()
    base = tide_xla.live_states()
    run = _step(mesh)
    run()
    during = tide_xla.live_states()
    assert during["group_states"] >= base["group_states"] + 2, (base, during)  # AG and RS
    assert during["arena_bytes"] > base["arena_bytes"] + ROWS * COLS, (base, during)
    freed = tide_xla.release(mesh, "fsdp")
    assert freed == during["group_states"] - base["group_states"], (freed, base, during)
    assert tide_xla.live_states() == base
    assert tide_xla.release(mesh, "fsdp") == 0  # no context left: a no-op
    with pytest.raises(Exception, match="tide_xla.release") as e:
        run()
    assert "INVALID_ARGUMENT" in str(e.value), e.value
    assert tide_xla.live_states() == base  # the refused call built nothing
    tide_xla.init(mesh, "fsdp", topology=(2, 4))  # the same executable runs on fresh states
    run()
    assert tide_xla.live_states() == during
    tide_xla.release(mesh, "fsdp")
    assert tide_xla.live_states() == base


def test_reinit_releases_the_old_states_and_the_context_manager_releases():
    mesh = _mesh()
    base = tide_xla.live_states()
    _step(mesh, (2, 4))()
    first = tide_xla.live_states()
    assert first["group_states"] > base["group_states"]
    tide_xla.init(mesh, "fsdp", topology=(4, 2))  # another topology: the old states go first
    assert tide_xla.live_states() == base
    with tide_xla.init(mesh, "fsdp", topology=(4, 2)) as ctx:
        assert ctx.nodes == 4
        _step(mesh, (4, 2))()  # (re-inits inside: same context key)
        assert tide_xla.live_states()["group_states"] > base["group_states"]
    assert tide_xla.live_states() == base
    with pytest.raises(ValueError, match="call tide_xla.init"):
        tide_xla.context.context_for(mesh, "fsdp")


def test_repeated_init_step_release_keeps_memory_flat():
    """The same executable, N times: init -> step -> release. Each step's states hold ~14 MiB of
    arenas (8 ranks: the pulled AG's stage and counters, the RS state's plan layout); kept, the
    later steps would add them up."""
    mesh = _mesh()
    base = tide_xla.live_states()
    run = _step(mesh)
    rss, held = [], []
    for i in range(16):
        if i:
            tide_xla.init(mesh, "fsdp", topology=(2, 4))
        run()
        held.append(tide_xla.live_states()["arena_bytes"] - base["arena_bytes"])
        tide_xla.release(mesh, "fsdp")
        assert tide_xla.live_states() == base
        rss.append(_rss_bytes())
    assert held[0] > 8 << 20 and len(set(held)) == 1, held
    # Kept states would keep their arenas' touched pages (the AG stage, the RS scratch and
    # counters: ~3.8 MB a step here; the RS state's ring slots are never touched) for each of the
    # 13 steps after rss[2], well past 2 x held; the process's own growth is ~1 MiB a step.
    grown = rss[-1] - rss[2]
    assert grown < 2 * held[0], ([r >> 20 for r in rss], held[0] >> 20)


def test_a_jax_process_exits_without_nanobind_leaks():
    """A process that ran TIDE steps and exits holding its context, layout and executable (no
    release): nothing of tide._core or tide_xla._ffi is reported leaked by nanobind at exit."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import test_xla_lifetime as t, tide_xla\n"
            "m = t._mesh(); run = t._step(m); run(); run()\n"
            "assert tide_xla.live_states()['group_states'] >= 2\n"
            "print('tide-xla-exit ok')\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "tide-xla-exit ok" in res.stdout, res.stderr[-4000:]
    assert "leaked" not in res.stderr, res.stderr[-4000:]
