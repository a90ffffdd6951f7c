"""One process of the NNX acceptance run (tests/test_xla_nnx_processes.py launches it).

    python tests/_xla_nnx_worker.py OUT_DIR PROCESS PROCESSES PORT CASE [TOPOLOGY]

A Flax NNX model that no other test holds (a strided conv stem, two MLP-mixer blocks: token- and
channel-mixing MLPs under LayerNorms, a gated head with a (1,)-row temperature) trains STEPS AdamW
steps with tide_xla (gather in bf16 from fp32 shards, TIDE-RS gradients averaged over the FSDP
axis). The mesh is every device of the job in id order, so rank r holds the same batch rows and
shards everywhere. CASE "train" runs the job's TOPOLOGY (as jax.distributed processes when
PROCESSES > 1); "reference" is one process holding every device that runs each topology the test
compares against ("1x8", "2x4"). Writes OUT_DIR/p<PROCESS>.npz: per topology, every addressable
shard of the final parameters and each step's per-device losses (raw bytes), keyed by the global
row it starts at; or OUT_DIR/p<PROCESS>.err.
"""
import os
import sys
import traceback

out_dir, me, nproc, port, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
topology = sys.argv[6] if len(sys.argv) > 6 else "1x8"
STEPS, BATCH, IMAGE, CHANNELS, CLASSES = 3, 2, 8, 12, 5   # BATCH images per device


def model_class(jax, jnp, nnx):
    class Mixer(nnx.Module):
        def __init__(self, tokens, channels, rngs):
            self.norms = nnx.List([nnx.LayerNorm(channels, rngs=rngs) for _ in range(2)])
            self.token_mlp = nnx.Dict(up=nnx.Linear(tokens, 2 * tokens, rngs=rngs),
                                      down=nnx.Linear(2 * tokens, tokens, rngs=rngs))
            self.channel_mlp = nnx.Dict(up=nnx.Linear(channels, 20, rngs=rngs),
                                        down=nnx.Linear(20, channels, use_bias=False, rngs=rngs))

        def __call__(self, x):  # (batch, tokens, channels)
            y = jnp.swapaxes(self.norms[0](x), 1, 2)
            y = self.token_mlp["down"](jax.nn.gelu(self.token_mlp["up"](y)))
            x = x + jnp.swapaxes(y, 1, 2)
            return x + self.channel_mlp["down"](jax.nn.gelu(self.channel_mlp["up"](self.norms[1](x))))

    class ConvMixer(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Conv(3, CHANNELS, kernel_size=(3, 3), strides=(2, 2), rngs=rngs)
            tokens = (IMAGE // 2) ** 2
            self.blocks = nnx.List([Mixer(tokens, CHANNELS, rngs) for _ in range(2)])
            self.head = nnx.Dict(gate=nnx.Linear(CHANNELS, CHANNELS, rngs=rngs),
                                 out=nnx.Linear(CHANNELS, CLASSES, rngs=rngs))
            self.temperature = nnx.Param(jnp.full((1,), 0.7, jnp.float32))

        def __call__(self, images):
            x = self.stem(images)
            x = x.reshape(x.shape[0], -1, x.shape[-1])
            for b in self.blocks:
                x = b(x)
            x = jnp.mean(x, axis=1)
            x = x * jax.nn.sigmoid(self.head["gate"](x))
            return self.head["out"](x) * self.temperature[...]

    return ConvMixer


def train(jax, jnp, np, nnx, optax, tide_xla, mesh, topo, state, graphdef, images, labels):
    from jax.sharding import NamedSharding, PartitionSpec as P
    tide_xla.init(mesh, "fsdp", topology=topo, timeout_s=20.0)
    shards, layout = tide_xla.shard(state, mesh, "fsdp")
    n = mesh.shape["fsdp"]
    rows = NamedSharding(mesh, P("fsdp"))
    x, y = jax.device_put(images, rows), jax.device_put(labels, rows)
    tx = optax.adamw(3e-2, weight_decay=0.05)
    rep = NamedSharding(mesh, P())
    opt = jax.tree.map(lambda v: v if v.ndim else jax.device_put(v, rep), tx.init(shards))

    def local(s, xb, yb):
        def loss(s):
            logits = nnx.merge(graphdef, tide_xla.gather(s, layout, grad_scale=1.0 / n))(xb).astype(jnp.float32)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], -1))
        value, grads = jax.value_and_grad(loss)(s)
        return value[None], grads

    grad = jax.shard_map(local, mesh=mesh, in_specs=(layout.specs, P("fsdp"), P("fsdp")),
                         out_specs=(P("fsdp"), layout.specs))

    @jax.jit
    def step(s, o, xb, yb):
        losses, g = grad(s, xb, yb)
        updates, o = tx.update(g, o, s)
        return optax.apply_updates(s, updates), o, losses

    out = {}
    for i in range(STEPS):
        shards, opt, losses = step(shards, opt, x, y)
        for sh in losses.addressable_shards:
            out[f"{topology_name(topo)}/loss{i}/{sh.index[0].start or 0}"] = np.asarray(sh.data).view(np.uint8)
    for path, leaf in jax.tree_util.tree_flatten_with_path(shards)[0]:
        for sh in leaf.addressable_shards:
            key = f"{topology_name(topo)}/{jax.tree_util.keystr(path)}/{sh.index[0].start or 0}"
            out[key] = np.asarray(sh.data).view(np.uint8)
    jax.block_until_ready(shards)
    tide_xla.release(mesh, "fsdp")
    return out


def topology_name(topo):
    return f"{topo[0]}x{topo[1]}"


def main():
    import jax
    if nproc > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc,
                                   process_id=me, initialization_timeout=30)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    import tide_xla

    devs = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devs), ("fsdp",))
    model = model_class(jax, jnp, nnx)(nnx.Rngs(3))
    graphdef, state = nnx.split(model, nnx.Param)
    state = jax.tree.map(np.asarray, state)  # host values, the same on every process
    rng = np.random.default_rng(11)
    images = rng.standard_normal((len(devs) * BATCH, IMAGE, IMAGE, 3)).astype(np.float32)
    labels = rng.integers(0, CLASSES, len(devs) * BATCH).astype(np.int32)
    topologies = ["1x8", "2x4"] if case == "reference" else [topology]
    out = {}
    for t in topologies:
        topo = tuple(int(v) for v in t.split("x"))
        out.update(train(jax, jnp, np, nnx, optax, tide_xla, mesh, topo, state, graphdef, images, labels))
    return out


try:
    res = main()
    import numpy as np
    np.savez(os.path.join(out_dir, f"p{me}.npz"), **res)
except BaseException:  # noqa: BLE001 - the test reads the text
    with open(os.path.join(out_dir, f"p{me}.err"), "w") as f:
        f.write(traceback.format_exc())
    sys.exit(1)
