"""Checkpoint a tide_xla training run with orbax-checkpoint, restore it on another device count,
and export the unsharded parameters (docs/xla.md, "Checkpoints and export").

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python examples/flax_checkpoint.py [--dir D]

A Flax NNX MLP trains 3 AdamW steps over an 8-device "fsdp" mesh through tide_xla (TIDE-AG
forward, TIDE-RS backward); the fp32 master shards and the optax state go to an orbax
checkpoint as they are (dim-0 padded, sharded). A second mesh of 3 devices restores them: its
shards have R_p = ceil(D_p / 3) rows; tide_xla.restore checks the leaf shapes saved with the
checkpoint against the new layout, then orbax truncates or zero-pads dim 0 to them (strict=False),
and the padding rows it adds or drops are zero (TIDE-RS gives them no gradient; AdamW keeps zero
at zero). The run then trains on, and `tide_xla.unshard` exports the parameters in their original
shapes and dtypes to an .npz. On several processes every process runs the same lines (orbax writes
each process's shards; unshard's tree is whole on every process).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if glob.glob(os.path.join(_ROOT, "tide", "_core*.so")):
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(13, 37, rngs=rngs), nnx.Linear(37, 5, rngs=rngs)])

    def __call__(self, x):
        return self.layers[1](jax.nn.gelu(self.layers[0](x)))


def setup(devices, graphdef, params, tx):
    """Mesh, TIDE context, shards, optax state (scalars on the whole mesh) and the jitted step."""
    mesh = Mesh(np.array(devices), ("fsdp",))
    tide_xla.init(mesh, "fsdp")
    shards, layout = tide_xla.shard(params, mesh, "fsdp")
    rep = NamedSharding(mesh, P())
    opt = jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, rep), tx.init(shards))

    def local_loss(local, x, y):
        full = tide_xla.gather(local, layout, grad_scale=1.0 / len(devices))
        return jnp.mean((nnx.merge(graphdef, full)(x.astype(jnp.bfloat16)).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(shards, opt, x, y):
        grads = jax.shard_map(jax.grad(local_loss), mesh=mesh, in_specs=(layout.specs, P(), P()),
                              out_specs=layout.specs)(shards, x, y)
        updates, opt = tx.update(grads, opt, shards)
        return optax.apply_updates(shards, updates), opt

    return mesh, shards, layout, opt, step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = ap.parse_args()
    root = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="tide_ckpt_"))
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 13)).astype(np.float32), rng.standard_normal((16, 5)).astype(np.float32)
    tx = optax.adamw(1e-2, weight_decay=0.1)

    mesh8, shards, layout8, opt, step8 = setup(jax.devices()[:8], graphdef, params, tx)
    for _ in range(3):
        shards, opt = step8(shards, opt, x, y)
    ckpt = ocp.StandardCheckpointer()
    # The leaf shapes go with it: a restore into another model's shapes is refused, naming the leaf.
    ckpt.save(os.path.join(root, "step3"), {"shards": shards, "opt": opt},
              custom_metadata=tide_xla.checkpoint_metadata(layout8))
    ckpt.wait_until_finished()
    saved = tide_xla.unshard(shards, layout8)
    tide_xla.release(mesh8, "fsdp")

    # Another device count: fresh shards and state on it are the restore target (shapes, shardings).
    mesh3, target, layout3, opt3, step3 = setup(jax.devices()[:3], graphdef, params, tx)
    got = tide_xla.restore(ckpt, os.path.join(root, "step3"), {"shards": target, "opt": opt3}, layout3)
    shards, opt = got["shards"], got["opt"]
    back = tide_xla.unshard(shards, layout3)
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(back)))
    print(f"restored on 3 devices from 8: parameters {'bitwise equal' if same else 'DIFFER'}; "
          f"Adam step count {int(opt[0].count)}")
    shards, opt = step3(shards, opt, x, y)
    export = os.path.join(root, "params.npz")  # the original shapes and dtypes, no padding rows
    flat = jax.tree_util.tree_flatten_with_path(tide_xla.unshard(shards, layout3))[0]
    np.savez(export, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
    print(f"exported {len(flat)} parameters after step 4 to {export}")
    tide_xla.release(mesh3, "fsdp")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
