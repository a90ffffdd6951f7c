"""Train examples/fsdp2_llama.py's Llama-style model in Flax NNX two ways and compare: TIDE
(tide_xla) and XLA's own sharding (GSPMD).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python examples/flax_fsdp.py [--steps 20]
    .venv/bin/python examples/flax_fsdp.py --size small --json out.json --separate   # on GPUs: those present

The model, its initial weights (numpy, --seed), the tokens and AdamW's hyperparameters come from
tide_apps/llama_spec.py, as in the PyTorch example, so that both frameworks train the same
model from the same bytes (--size and the per-field overrides are the same flags; --batch is
sequences per device, so the global batch is batch x devices in both). Both runs shard the fp32
parameters on dim 0 over an "fsdp" mesh axis of up to 8 devices and compute in bf16 (FSDP2's
MixedPrecisionPolicy(bf16, fp32)). TIDE: one TIDE-AG call per FSDP2 group (each block; the
embedding, final norm and head together) gathers bf16 parameters inside `jax.shard_map`, and
the backward reduces bf16 gradients into fp32 shards with TIDE-RS. GSPMD: the same step under
`jax.jit` with NamedSharding annotations; XLA inserts its own all-gathers and reduce-scatters.
On XLA:CPU the devices are threads of one process (TIDE's in-process virtual cluster), so step
times show overheads, not the network. When jax has a GPU backend the mesh is the GPUs present
(up to 8) and TIDE runs through the CUDA handlers; one GPU keeps stock casts (tide_xla's world-1
policy) unless --serve-single-rank.

The last line is the verdict on the two runs' losses: tide_xla against GSPMD, the largest
difference over the steps within LOSS_RTOL (2e-3) of GSPMD's loss (not bitwise: the gradients
are summed in other orders).

--json PATH writes {"framework": "jax", "device": device_kind, "world": N, "model"
(llama_spec.describe), "runs": [{"name", "step_ms" (median after --warmup steps; the first
compiles), "peak_bytes" (memory_stats()["peak_bytes_in_use"] of device 0, plus for tide_xla its
arenas there, or null), "final_loss", "losses", "params_sha256" (the final parameters' bytes),
"layout_copies" ({op: {"calls", "bytes"}} per step and device, or null where not counted),
"copies_source"}]}. The peak is the process' peak so far; --separate runs each framework in its
own process so that it is per run.

--processes N (XLA:CPU) runs the same job as N jax.distributed processes of this host, 8/N
devices each (gloo's "[Gloo] Rank r is connected to ..." lines dropped), then as one process
holding the 8 devices, and prints the parameter-bytes check: TIDE's parameters end bitwise equal
to one process's (exit status 1 if not; --no-check skips the one-process run). The printed losses
may differ in the last bits: XLA's cross-process pmean sums in another order. --processes N
--shared-gpu runs them on GPU 0, one device each, every process an emulated host (its own
NCCL_HOSTID: XLA's collectives and TIDE's rails over NCCL's loopback sockets, TIDE's ranks of one
node by CUDA IPC); --nodes M is TIDE's topology (default: one node per process).
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
import tide_xla._registration  # noqa: E402
import tide_xla.sharding  # noqa: E402

from tide_apps import llama_spec as common  # noqa: E402

F32 = jnp.float32


class Embedding(nnx.Module):
    def __init__(self, weight):
        self.weight = nnx.Param(weight)  # (vocab, dim), as nn.Embedding

    def __call__(self, tokens):
        return jnp.take(self.weight[...], tokens, axis=0)


class Linear(nnx.Module):
    """Bias-free; the weight is (out_features, in_features) as nn.Linear stores it, so both
    frameworks shard the same dim 0."""

    def __init__(self, weight):
        self.weight = nnx.Param(weight)

    def __call__(self, x):
        return x @ self.weight[...].T


class RMSNorm(nnx.Module):
    def __init__(self, weight):
        self.weight = nnx.Param(weight)

    def __call__(self, x):  # statistics in fp32, the result in x's dtype (bf16), as torch's
        x32 = x.astype(F32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + common.RMS_EPS)
        return (y * self.weight[...].astype(F32)).astype(x.dtype)


class Block(nnx.Module):
    """fsdp2_llama.py's Block: RMSNorm, causal GQA attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, cfg, w: dict, prefix: str):
        self.heads, self.kv_heads, self.hd = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        for name in ("attention_norm", "ffn_norm"):
            setattr(self, name, RMSNorm(w[f"{prefix}{name}.weight"]))
        for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            setattr(self, name, Linear(w[f"{prefix}{name}.weight"]))

    def __call__(self, x):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).reshape(b, t, self.heads, self.hd)
        rep = self.heads // self.kv_heads  # torch's repeat_interleave over the head dim
        k = jnp.repeat(self.wk(h).reshape(b, t, self.kv_heads, self.hd), rep, axis=2)
        v = jnp.repeat(self.wv(h).reshape(b, t, self.kv_heads, self.hd), rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) / np.sqrt(self.hd)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        x = x + self.wo(y.reshape(b, t, -1))
        n = self.ffn_norm(x)
        return x + self.w2(jax.nn.silu(self.w1(n)) * self.w3(n))


class Llama(nnx.Module):
    """fsdp2_llama.py's Llama, built from llama_spec's weights (numpy, by torch name)."""

    def __init__(self, cfg, w: dict):
        self.tok_embeddings = Embedding(w["tok_embeddings.weight"])
        self.layers = nnx.List([Block(cfg, w, f"layers.{i}.") for i in range(cfg.layers)])
        self.norm = RMSNorm(w["norm.weight"])
        self.output = Linear(w["output.weight"])

    def __call__(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def group_key(path):
    """FSDP2's groups (fully_shard on every block, then on the root): one TIDE group per block
    and one for the embedding, the final norm and the head together."""
    key = tide_xla.sharding.default_group_key(path)
    return key if key[0] == "layers" else ("root",)


def loss_fn(graphdef, params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(F32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def train_tide(mesh, graphdef, params, tx, data, warmup, nodes=0, serve_single_rank=False):
    n = mesh.shape["fsdp"]
    # One device: stock casts unless serve_single_rank (one log line; docs/xla.md, "World 1")
    tide_xla.init(mesh, "fsdp", topology=(nodes, n // nodes) if nodes else None,
                  serve_single_rank=serve_single_rank)
    # fp32 master shards, dim 0 padded; FSDP2's groups
    shards, layout = tide_xla.shard(params, mesh, "fsdp", group_key=group_key)
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

    # The copy the XLA face adds where TIDE-AG cannot land in XLA's results (docs/xla.md): the
    # group's unsharded bf16 parameters, copied out of the arena landing; 0 for a group that
    # lands there by pulling (fp32 shards, any number of nodes). Calls per step: the tide_all_gather custom
    # calls of the lowered step (each group gathered once).
    hlo = step.lower(shards, opt_state, jax.ShapeDtypeStruct(data[0].shape, jnp.int32)).as_text()
    calls = hlo.count("@tide_all_gather")
    out_bytes = tide_xla.copy_out_bytes(layout)
    copies = {"tide_xla landing -> XLA result (added)": {
        "calls": sum(1 for b in out_bytes.values() if b), "bytes": sum(out_bytes.values())
        if calls == len(layout.groups) else None}}
    ffi = tide_xla._registration.ffi_module()
    record = run("tide_xla", step, shards, opt_state, mesh, data, warmup, at_warmup=ffi.reset_handler_stats)
    # Where tide_xla's time goes on the host: the handlers' wall time on XLA's launch threads over
    # the timed steps (every local device's calls), against the step itself.
    timed = max(1, len(data) - warmup)
    calls = sum(c for c, _ in ffi.handler_stats().values())
    host_us = sum(ns for _, ns in ffi.handler_stats().values()) / 1e3 / timed
    local = len(mesh.local_devices)
    record["handler_host_us_per_step"] = host_us
    if jax.process_index() == 0:
        print(f"  tide_xla handlers: {calls / timed / local:.0f} calls per step and device, {host_us / local:.0f} us of "
              f"host time per step and device ({host_us / max(1, calls / timed):.0f} us per call; the step "
              f"is {record['step_ms'] * 1e3:.0f} us)")
    if record["peak_bytes"] is not None:  # TIDE's arenas are outside XLA's allocator
        record["peak_bytes"] += tide_xla.arena_bytes(mesh.devices.flat[0])
    record.update(layout_copies=copies, copies_source="tide_xla.copy_out_bytes, per device: "
                  "the bf16 parameters each TIDE-AG call copies out of its arena landing (0: pulled into "
                  "XLA's results)")
    return record


def train_gspmd(mesh, graphdef, params, tx, data, warmup, nodes=0, serve_single_rank=False):
    n = mesh.shape["fsdp"]

    def spec(x):  # dim-0 sharding where it divides evenly; XLA's own choice otherwise
        return NamedSharding(mesh, P("fsdp") if x.ndim and x.shape[0] % n == 0 else P())

    params = jax.tree.map(lambda x: jax.device_put(x.astype(np.float32), spec(x)), params)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        def loss(p):
            return loss_fn(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), tokens)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    record = run("gspmd", step, params, opt_state, mesh, data, warmup)
    record.update(layout_copies=None, copies_source="not counted: XLA's own collectives and "
                  "copies are inside the compiled program (no FSDP2 layout copies to count)")
    return record


def run(name, step, params, opt_state, mesh, data, warmup, at_warmup=None):
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    data_sharding = NamedSharding(mesh, P("fsdp"))
    times, losses = [], []
    for i, tokens in enumerate(data):
        if i == warmup and at_warmup:
            at_warmup()
        tokens = jax.device_put(tokens, data_sharding)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if i == 0 or (i + 1) % 5 == 0:
            say(f"  {name:9s} step {i + 1:3d}  loss {loss:.4f}  {times[-1] * 1e3:8.1f} ms"
                  + ("  (includes compile)" if i == 0 else ""))
    steady = times[warmup:] or times[-1:]
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
    """Each run in a fresh process (its own peak_bytes); returns (the first run's JSON, the runs'
    records in order).
    argv_rest: the arguments that make the model, data and steps, passed on to each."""
    out, head = [], None
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--runs", name, "--json", f.name,
                   *argv_rest]
            subprocess.run(cmd, check=True)
            obj = json.load(open(f.name))
            head = head or obj
            out += obj["runs"]
    return head, out


# gloo (inside jaxlib: jax.distributed's CPU collectives) prints one line per rank and
# communicator to stdout when its ranks connect, with no setting to turn it off; the launcher
# drops those lines from its children's output. A process's ranks connect on several threads at
# once, so their lines can interleave within one line: any line holding gloo's tag goes.
def _forward(stream, dst):
    for line in stream:
        if "[Gloo] " not in line:
            dst.write(line)
            dst.flush()


def launch_processes(n, argv, shared_gpu=False, quiet=False):
    """--processes N: N processes on this host joined by jax.distributed on a free localhost port;
    on XLA:CPU 8/N host devices each, with --shared-gpu every process on GPU 0 as an emulated host
    (llama_spec.emulated_host_env). Process 0 prints and writes --json; `quiet`: nothing is
    printed. Returns the first non-zero exit status (0 when all succeeded)."""
    import socket
    import threading
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    if shared_gpu:
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", CUDA_VISIBLE_DEVICES="0")
        env.pop("JAX_PLATFORMS", None)
        env.pop("XLA_FLAGS", None)
    else:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // n}",
                   JAX_PLATFORMS="cpu")
    env["PYTHONUNBUFFERED"] = "1"
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--process-id", str(i),
                               "--coordinator", f"localhost:{port}"],
                              env=dict(env, **(common.emulated_host_env(i) if shared_gpu else {})),
                              stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    sink = open(os.devnull, "w") if quiet else sys.stdout
    pumps = [threading.Thread(target=_forward, args=(p.stdout, sink), daemon=True) for p in procs]
    for t in pumps:
        t.start()
    codes = [p.wait() for p in procs]
    for t in pumps:
        t.join()
    if quiet:
        sink.close()
    return next((c for c in codes if c), 0)


def model_argv(args):
    """The arguments that make the same model, data, steps and topology in another process."""
    out = ["--size", args.size, "--seed", str(args.seed), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--nodes", str(args.nodes)]
    out += ["--serve-single-rank"] if args.serve_single_rank else []
    for k in common.FIELDS:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return out


def check_processes(args, names, argv):
    """--processes N on XLA:CPU: runs the job as N processes, then as one process holding the 8
    devices, and prints whether each run's final parameters have the same bytes (sha256 of every
    shard). tide_xla's must (TIDE's sums run in one fixed order whatever the processes); GSPMD's
    are XLA's business, shown as they come. Returns the exit status (1: tide_xla's differ)."""
    with tempfile.TemporaryDirectory(prefix="tide_flax_") as d:
        many_json = args.json or os.path.join(d, "many.json")
        rc = launch_processes(args.processes, [*argv, "--json", many_json])
        if rc:
            return rc
        one_json = os.path.join(d, "one.json")
        print("parameter bytes: the same job as 1 process holding the 8 devices, for comparison ...",
              flush=True)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), *model_argv(args),
                            "--runs", ",".join(names), "--json", one_json],
                           env=dict(os.environ, JAX_PLATFORMS="cpu",
                                    XLA_FLAGS="--xla_force_host_platform_device_count=8"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode:
            print(r.stdout[-3000:], end="")
            return r.returncode
        with open(many_json) as f:
            many = {x["name"]: x["params_sha256"] for x in json.load(f)["runs"]}
        with open(one_json) as f:
            one = {x["name"]: x["params_sha256"] for x in json.load(f)["runs"]}
    rc = 0
    for name in names:
        same = many[name] == one[name]
        note = ("bitwise equal" if same else
                "DIFFER" + (" -- TIDE's must not (FAIL)" if name == "tide_xla" else
                            " (XLA's own collectives: not promised)"))
        print(f"parameter bytes after {args.steps} steps, {name}: {args.processes} processes vs 1 "
              f"process: {note} (sha256 {many[name][:16]}... vs {one[name][:16]}...)")
        if name == "tide_xla" and not same:
            rc = 1
    return rc


# tide_xla against GSPMD: the same weights, tokens and math, but other summation orders (TIDE-RS
# against XLA's reduce-scatter, in bf16): not bitwise. Measured max |loss difference| over the
# steps relative to GSPMD's loss: 3e-5 (XLA:CPU, tiny, 20 steps), about 5e-4 (one H200, tiny, 30
# steps: 2.1e-3 absolute, BENCHMARKS.md). The tolerance leaves 4x room above the latter.
LOSS_RTOL = 2e-3


def loss_verdict(tide, gspmd):
    """One line: the largest loss difference over the steps against LOSS_RTOL, and the verdict."""
    diff = max(abs(a - b) for a, b in zip(tide["losses"], gspmd["losses"]))
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(tide["losses"], gspmd["losses"]))
    ok = rel <= LOSS_RTOL
    return ok, (f"max |loss difference| tide_xla vs gspmd over {len(tide['losses'])} steps: "
                f"{diff:.2e} (relative {rel:.1e}): "
                + ("bitwise equal" if diff == 0 else
                   f"{'within' if ok else 'OUTSIDE'} the tolerance of {LOSS_RTOL:g} relative "
                   "(not bitwise: the gradients are summed in other orders)"))


def main(argv=None):
    intro, usage = __doc__.split("\n\n")[:2]  # what it does, how to run it: whole paragraphs
    ap = argparse.ArgumentParser(description=intro, epilog="examples:\n" + usage,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_args(ap)  # --size, --vocab ... --batch (per device), --seq, --seed
    ap.add_argument("--steps", type=int, default=20, help="AdamW steps per run (default 20)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="steps left out of the median (the first one compiles)")
    ap.add_argument("--runs", default="gspmd,tide_xla", help="comma list of gspmd, tide_xla")
    ap.add_argument("--json", metavar="PATH", help="write step times and losses as JSON")
    ap.add_argument("--separate", action="store_true",
                    help="run each framework in its own process (per-run peak_bytes)")
    ap.add_argument("--processes", type=int, default=1, choices=(1, 2, 4, 8),
                    help="XLA:CPU: run the job as this many jax.distributed processes of this host "
                         "(8 devices in all); on a cluster, start one process per host yourself "
                         "with --process-id and --coordinator")
    ap.add_argument("--shared-gpu", action="store_true",
                    help="with --processes N: the N processes share GPU 0, each an emulated host (its own "
                         "NCCL_HOSTID, NCCL over loopback sockets): correctness and overheads, not bandwidth")
    ap.add_argument("--nodes", type=int, default=0,
                    help="TIDE's topology: this many nodes of world/nodes ranks (0: one node of up to 8; "
                         "with --shared-gpu: one per process)")
    ap.add_argument("--serve-single-rank", action="store_true",
                    help="one device: run tide_xla's handlers anyway (by default it keeps stock casts there)")
    ap.add_argument("--no-check", action="store_true",
                    help="with --processes N on XLA:CPU: skip the one-process run whose parameter "
                         "bytes the N processes' are checked against")
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    common.resolve(ap, args)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0 or args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    if args.shared_gpu and args.processes < 2:
        ap.error("--shared-gpu: with --processes N >= 2")
    if args.shared_gpu and args.nodes == 0:
        args.nodes = args.processes
    names = [r for r in args.runs.split(",") if r]
    for r in names:
        if r not in RUNS:
            ap.error(f"--runs: unknown run {r!r} (known: {', '.join(RUNS)})")
    separate = args.separate and len(names) > 1 and args.process_id is None
    if args.processes > 1 and args.process_id is None and not separate:
        argv = sys.argv[1:] if argv is None else list(argv)
        if args.shared_gpu or args.no_check:
            raise SystemExit(launch_processes(args.processes, argv, args.shared_gpu))
        raise SystemExit(check_processes(args, names, argv))
    if args.process_id is not None:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes,
                                   process_id=args.process_id, initialization_timeout=60)
    lead = args.process_id in (None, 0)  # (jax.process_index() would start a backend here)
    out = print if lead else (lambda *a, **k: None)
    if separate:
        # Each run in processes of its own; this one touches no backend (its memory is not counted).
        model_args = [*model_argv(args), "--processes", str(args.processes)]
        model_args += ["--shared-gpu"] if args.shared_gpu else []
        model_args += ["--no-check"] if args.no_check else []
        head, records = run_separately(names, model_args)
        device_kind, n = head["device"], head["world"]
    else:
        devices = sorted(jax.devices(), key=lambda d: d.id)  # every process's, process-major
        if len(devices) < 2 and devices[0].platform == "cpu":
            raise SystemExit("needs several devices: "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=8")
        n, device_kind = min(8, len(devices)), devices[0].device_kind
        mesh = Mesh(np.array(devices[:n]), ("fsdp",))
        # numpy leaves: each run puts its own copy on the devices (a run donates its parameters
        # to its train step)
        model = Llama(args, dict(common.init_weights(args, args.seed)))
        graphdef, params = nnx.split(model, nnx.Param)
        count = sum(x.size for x in jax.tree.leaves(params))
        out(f"Llama {args.size}: {count} parameters, {n} devices ({device_kind}) in "
            f"{jax.process_count()} process(es), batch {args.batch} x {n} x {args.seq}")
        hp = common.ADAMW
        tx = optax.adamw(hp["lr"], b1=hp["betas"][0], b2=hp["betas"][1], eps=hp["eps"],
                         weight_decay=hp["weight_decay"])
        data = common.token_batches(args, args.steps, args.batch * n, args.seed)
        records = [RUNS[r](mesh, graphdef, params, tx, data, args.warmup, args.nodes, args.serve_single_rank) for r in names]
    by_name = {r["name"]: r for r in records}
    if len(by_name) == 2:
        out(loss_verdict(by_name["tide_xla"], by_name["gspmd"])[1])
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump({"framework": "jax", "device": device_kind, "world": n,
                       "model": common.describe(args, n), "runs": records}, f, indent=1)


if __name__ == "__main__":
    main()
