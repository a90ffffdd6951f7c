"""Train one small Flax NNX transformer two ways and compare: TIDE (tide_xla) and XLA's own
sharding (GSPMD).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/flax_fsdp.py [--steps 20]
    python examples/flax_fsdp.py --json out.json --separate     # on GPUs: the GPUs present

Both runs shard the fp32 parameters on dim 0 over an 8-device "fsdp" mesh axis and compute in
bf16. TIDE: one TIDE-AG call per layer group gathers bf16 parameters inside `jax.shard_map`, and
the backward reduces bf16 gradients into fp32 shards with TIDE-RS. GSPMD: the same step under
`jax.jit` with NamedSharding annotations; XLA inserts its own all-gathers and reduce-scatters.
On XLA:CPU the devices are threads of one process (TIDE's in-process virtual cluster), so step
times show overheads, not the network. When jax has a GPU backend the mesh is the GPUs present
(up to 8; one GPU is a 1 x 1 topology) and TIDE runs through the CUDA handlers.

--json PATH writes {"framework": "jax", "device": device_kind, "world": N, "runs": [{"name",
"step_ms" (median after the first, compiling, step), "peak_bytes" (memory_stats()
["peak_bytes_in_use"] of device 0, or null), "final_loss", "losses", "params_sha256" (the final
parameters' bytes)}]}. --processes N (XLA:CPU) runs the same job as N jax.distributed processes of
this host, 8/N devices each; TIDE's parameters end bitwise equal to one process's (the printed
losses may differ in the last bits: XLA's cross-process pmean sums in another order). The peak is the process'
peak so far; --separate runs each framework in its own process so that it is per run.
"""
from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# A checkout whose core is built in place (make build) runs from the checkout; otherwise the
# installed packages (pip install .) are used.
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if glob.glob(os.path.join(_ROOT, "tide", "_core*.so")):
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tide_xla  # noqa: E402

VOCAB, DIM, HEADS, FF, LAYERS, SEQ = 128, 64, 4, 176, 2, 32


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, FF, rngs=rngs)
        self.down = nnx.Linear(FF, DIM, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
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


def loss_fn(graphdef, params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def batches(steps, batch, seed=0):
    """Learnable synthetic data: each sequence counts up from a random start (mod VOCAB)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (batch, 1))
        yield ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)  # host data: device_put shards it


def train_tide(mesh, graphdef, params, tx, steps, batch):
    n = mesh.shape["fsdp"]
    tide_xla.init(mesh, "fsdp")
    shards, layout = tide_xla.shard(params, mesh, "fsdp")  # fp32 master shards, dim 0 padded
    opt_state = tx.init(shards)

    def local_loss(local_shards, tokens):
        full = tide_xla.gather(local_shards, layout, grad_scale=1.0 / n)  # bf16 parameters
        return loss_fn(graphdef, full, tokens)

    def local_step(local_shards, tokens):
        loss, grads = jax.value_and_grad(local_loss)(local_shards, tokens)
        return jax.lax.pmean(loss, "fsdp"), grads  # grads: fp32 shards from TIDE-RS

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(shards, opt_state, tokens):
        loss, grads = jax.shard_map(local_step, mesh=mesh, in_specs=(layout.specs, P("fsdp")),
                                    out_specs=(P(), layout.specs))(shards, tokens)
        updates, opt_state = tx.update(grads, opt_state, shards)
        return optax.apply_updates(shards, updates), opt_state, loss

    return run("tide_xla", step, shards, opt_state, mesh, steps, batch)


def train_gspmd(mesh, graphdef, params, tx, steps, batch):
    n = mesh.shape["fsdp"]

    def spec(x):  # dim-0 sharding where it divides evenly; XLA's own choice otherwise
        return NamedSharding(mesh, P("fsdp") if x.ndim and x.shape[0] % n == 0 else P())

    params = jax.tree.map(lambda x: jax.device_put(x.astype(jnp.float32), spec(x)), params)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        def loss(p):
            return loss_fn(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), tokens)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return run("gspmd", step, params, opt_state, mesh, steps, batch)


def run(name, step, params, opt_state, mesh, steps, batch):
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    data_sharding = NamedSharding(mesh, P("fsdp"))
    times, losses = [], []
    for i, tokens in enumerate(batches(steps, batch)):
        tokens = jax.device_put(tokens, data_sharding)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if i == 0 or (i + 1) % 5 == 0:
            say(f"  {name:9s} step {i + 1:3d}  loss {loss:.4f}  {times[-1] * 1e3:8.1f} ms"
                  + ("  (includes compile)" if i == 0 else ""))
    steady = times[1:] or times
    say(f"{name:9s} median step {np.median(steady) * 1e3:.1f} ms, loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}")
    return {"name": name, "step_ms": float(np.median(steady) * 1e3),
            "peak_bytes": peak_bytes(mesh.devices.flat[0]), "final_loss": float(losses[-1]),
            "losses": [float(v) for v in losses], "params_sha256": params_digest(params)}


def params_digest(params):
    """sha256 of the final parameters' bytes (every process's shards, gathered): equal digests
    mean bitwise equal parameters, e.g. across --processes."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(params, tiled=True)
    h = hashlib.sha256()
    for x in jax.tree.leaves(params):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def peak_bytes(device):
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator statistics
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


RUNS = {"gspmd": train_gspmd, "tide_xla": train_tide}


def run_separately(names, argv_rest):
    """Each run in a fresh process (its own peak_bytes); returns the runs' records in order."""
    out = []
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--runs", name, "--json", f.name,
                   *argv_rest]
            subprocess.run(cmd, check=True)
            out += json.load(open(f.name))["runs"]
    return out


def launch_processes(n, argv):
    """--processes N on XLA:CPU: N processes on this host, 8/N host devices each, joined by
    jax.distributed on a free localhost port; process 0 prints and writes --json. Returns the
    first non-zero exit status (0 when all succeeded)."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // n}",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--process-id", str(i),
                               "--coordinator", f"localhost:{port}"], env=env) for i in range(n)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--runs", default="gspmd,tide_xla", help="comma list of gspmd, tide_xla")
    ap.add_argument("--json", metavar="PATH", help="write step times and losses as JSON")
    ap.add_argument("--separate", action="store_true",
                    help="run each framework in its own process (per-run peak_bytes)")
    ap.add_argument("--processes", type=int, default=1, choices=(1, 2, 4, 8),
                    help="XLA:CPU: run the job as this many jax.distributed processes of this host "
                         "(8 devices in all); on a cluster, start one process per host yourself "
                         "with --process-id and --coordinator")
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.processes > 1 and args.process_id is None:
        raise SystemExit(launch_processes(args.processes, sys.argv[1:] if argv is None else list(argv)))
    if args.process_id is not None:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes,
                                   process_id=args.process_id, initialization_timeout=60)
    lead = jax.process_index() == 0
    out = print if lead else (lambda *a, **k: None)
    names = [r for r in args.runs.split(",") if r]
    for r in names:
        if r not in RUNS:
            raise SystemExit(f"--runs: unknown run {r!r} (known: {', '.join(RUNS)})")
    devices = sorted(jax.devices(), key=lambda d: d.id)  # every process's, process-major
    if len(devices) < 2 and devices[0].platform == "cpu":
        raise SystemExit("needs several devices: "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    n = min(8, len(devices))
    if args.separate and len(names) > 1:
        records = run_separately(names, ["--steps", str(args.steps), "--batch", str(args.batch)])
    else:
        mesh = Mesh(np.array(devices[:n]), ("fsdp",))
        graphdef, params = nnx.split(Transformer(nnx.Rngs(0)), nnx.Param)
        count = sum(x.size for x in jax.tree.leaves(params))
        out(f"{count} parameters, {n} devices ({devices[0].device_kind}) in {jax.process_count()} "
            f"process(es), batch {args.batch} x {SEQ}")
        tx = optax.adamw(3e-3)
        # each run starts from its own copy: a run donates its parameters to its train step
        records = [RUNS[r](mesh, graphdef, jax.tree.map(jnp.copy, params), tx, args.steps, args.batch)
                   for r in names]
    by_name = {r["name"]: r for r in records}
    if len(by_name) == 2:
        diff = max(abs(a - b) for a, b in zip(by_name["tide_xla"]["losses"],
                                              by_name["gspmd"]["losses"]))
        out(f"max |loss difference| tide vs gspmd: {diff:.2e}")
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump({"framework": "jax", "device": devices[0].device_kind, "world": n,
                       "runs": records}, f, indent=1)


if __name__ == "__main__":
    main()
