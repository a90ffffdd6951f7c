"""World 1 ([Note: world 1] in tide_xla/context.py): an FSDP axis of one device keeps stock JAX
casts with one log line unless `init(serve_single_rank=True)`, the policy tide_torch.enable has;
both give the same bits."""
import functools
import logging
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402


def _run(serve, caplog):
    """Gather, its gradient and an accumulating reduce_scatter on a mesh of one device: the
    results' bits and the lowered step's text."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tide_xla"):
        ctx = tide_xla.init(mesh, "fsdp", serve_single_rank=serve)
    lines = [r.getMessage() for r in caplog.records if r.name == "tide_xla"]
    rng = np.random.default_rng(11)
    params = {"a": rng.standard_normal((37, 8)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32)}
    shards, layout = tide_xla.shard(params, mesh, "fsdp")

    def local(s, acc):
        full = tide_xla.gather(s, layout, grad_scale=0.5)
        g = jax.grad(lambda s: sum(jnp.sum(jnp.sin(v.astype(jnp.float32))) for v in
                                   tide_xla.gather(s, layout, grad_scale=0.5).values()))(s)
        acc = tide_xla.reduce_scatter(full, layout, scale=0.25, accumulate=acc)
        return {k: v[None] for k, v in full.items()}, g, acc

    packed = tide_xla.zeros_packed(layout)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layout.specs, [P("fsdp")] * len(packed)),
                               out_specs=({k: P("fsdp") for k in params}, layout.specs, [P("fsdp")] * len(packed))),
                 donate_argnums=(1,))
    text = fn.lower(shards, packed).as_text()
    out = jax.tree.map(lambda x: np.asarray(x).tobytes(), fn(shards, packed))
    tide_xla.release(mesh, "fsdp")
    return ctx, lines, text, out


def test_one_device_keeps_stock_with_one_log_line_and_the_same_bits(caplog):
    stock, lines, text, out = _run(False, caplog)
    assert not stock.served and "tide_all_gather" not in text and "tide_reduce_scatter" not in text
    assert len(lines) == 1 and "axis 'fsdp' of the mesh has one device" in lines[0], lines
    assert "serve_single_rank=True" in lines[0]
    served, lines, text, ref = _run(True, caplog)
    assert served.served and "tide_all_gather" in text and "tide_reduce_scatter" in text and not lines
    assert out == ref  # gather (bf16), its gradient (fp32 shards) and the accumulated RS


def test_serve_single_rank_is_checked_and_several_devices_are_served():
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    with pytest.raises(TypeError, match="serve_single_rank must be a bool, got 'yes'"):
        tide_xla.init(mesh, "fsdp", serve_single_rank="yes")
    assert tide_xla.init(mesh, "fsdp").served
    tide_xla.release(mesh, "fsdp")
