"""One process of a tide_xla run across processes (tests/test_xla_multiprocess.py launches it).

    python tests/_xla_mp_worker.py OUT_DIR PROCESS PROCESSES PORT CASE [TOPOLOGY]

PROCESSES = 1 runs alone (no jax.distributed: the one-process reference); otherwise the process
joins jax.distributed on localhost:PORT. Every process holds its XLA_FLAGS host devices; the mesh
is every device of the job in id order (process-major), so rank r is the same shard everywhere.
It writes OUT_DIR/p<PROCESS>.npz with its addressable shards of each result, keyed by the global
row the shard starts at, or OUT_DIR/p<PROCESS>.err with the error text.

The platform is JAX_PLATFORMS's (cpu, or cuda: one GPU per process, several processes may share
it). CASE: "run" (AG forward, AG+RS gradient, RS with scale and accumulate), "exact" (the same with
a loss whose gradient every platform computes to the same bits, for CPU against GPU), "other_model" (process 1
groups the parameters into other TIDE calls), "skip" (the last process never calls), "no_run" (the
last process traces and compiles the gather but never runs it), "no_shm" (process 1's /dev/shm
has no room for its segments), "release" ("run", then tide_xla.release: no state left, the AG
executable refused naming tide_xla.release, and after init again a fresh trace gathers the same
bits), "ckpt_save" (2 AdamW steps, an orbax save of the shards and the optax state into
$CKPT_DIR, then a third step), "ckpt_restore" (fresh shards and state on this job's mesh, the
orbax restore into them, a step); both write the unsharded params and moments too ("u/...");
"die_at_agreement", "die_at_segments", "die_at_rail", "die_mid_step" (the last process dies when it
reaches the call's agreement, before mapping its peers' segments (CPU), before joining its NCCL
rail (CUDA), or inside the step between two TIDE calls).
"""
import os
import sys
import time
import traceback

out_dir, me, nproc, port, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
topology = tuple(int(v) for v in sys.argv[6].split("x")) if len(sys.argv) > 6 else None
started = time.monotonic()


def main():
    import jax
    if nproc > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc,
                                   process_id=me, initialization_timeout=30)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import tide_xla

    if case == "no_shm" and me == 1:  # this process sees a /dev/shm with 4 KiB free
        from tide import shm
        shm.free_bytes = lambda: 4096
    devs = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devs), ("fsdp",))
    if case.startswith("ckpt"):
        return _checkpoint(jax, jnp, np, tide_xla, mesh)
    if case.startswith("die_"):
        return _die(jax, jnp, np, tide_xla, mesh)
    tide_xla.init(mesh, "fsdp", topology=topology, timeout_s=3.0 if case in ("skip", "no_run") else 20.0)
    rng = np.random.default_rng(7)
    shapes = {"a": (37, 8), "b": (16,), "c": (5, 3)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    # other_model: process 1 groups its leaves into one TIDE group (the arrays stay the same, so
    # nothing outside TIDE notices; different global shapes would already fail in device_put).
    key = (lambda path: "all") if case == "other_model" and me == 1 else tide_xla.default_group_key
    shards, layout = tide_xla.shard(params, mesh, "fsdp", group_key=key)
    n = mesh.shape["fsdp"]

    def gathered(s):
        full = tide_xla.gather(s, layout)
        return {k: v[None] for k, v in full.items()}

    def local_loss(s):
        full = tide_xla.gather(s, layout)
        r = jax.lax.axis_index("fsdp").astype(jnp.float32) + 1.0
        if case == "exact":  # d/dv = 2 v r: exact products of a bf16 value, the same bits everywhere
            return sum(jnp.sum(jnp.square(v.astype(jnp.float32)) * r) for v in full.values())
        return sum(jnp.sum(jnp.sin(v.astype(jnp.float32)) * r) for v in full.values())

    def rs(s):
        full = tide_xla.gather(s, layout)
        r = jax.lax.axis_index("fsdp").astype(jnp.float32) + 1.0
        g = {k: (v.astype(jnp.float32) * r).astype(v.dtype) for k, v in full.items()}
        acc = tide_xla.reduce_scatter(g, layout, scale=0.5)
        acc = tide_xla.reduce_scatter(g, layout, scale=0.25, accumulate=acc)
        return tide_xla.unpack_grads(acc, layout)

    specs = layout.specs
    stacked = {k: P("fsdp") for k in shapes}
    run_ag = jax.jit(jax.shard_map(gathered, mesh=mesh, in_specs=(specs,), out_specs=stacked))
    if case == "skip" and me == nproc - 1:
        return {}  # this process never calls
    if case == "no_run" and me == nproc - 1:
        run_ag.lower(shards).compile()  # traced (the processes agree), never run
        return {}
    results = {"ag": run_ag(shards)}
    if case in ("run", "exact", "release"):
        grad = jax.jit(jax.shard_map(jax.grad(local_loss), mesh=mesh, in_specs=(specs,),
                                     out_specs=specs))
        results["grad"] = grad(shards)
        results["rs"] = jax.jit(jax.shard_map(rs, mesh=mesh, in_specs=(specs,),
                                              out_specs=specs))(shards)
    if case == "release":
        _release_checks(jax, tide_xla, mesh, topology, run_ag, gathered, shards, specs, stacked, results)
    out = {}
    for what, tree in results.items():
        for k, x in tree.items():
            for s in x.addressable_shards:
                out[f"{what}/{k}/{s.index[0].start or 0}"] = np.asarray(s.data).view(np.uint8)
    assert n == len(devs)
    return out


def _release_checks(jax, tide_xla, mesh, topology, run_ag, gathered, shards, specs, stacked, results):
    import numpy as np
    jax.block_until_ready(results)
    live = tide_xla.live_states()
    assert live["rank_states"] > 0 and live["arena_bytes"] > 0 and live["group_states"] == 0, live
    assert tide_xla.release(mesh, "fsdp") == live["rank_states"]
    assert tide_xla.live_states() == {"group_states": 0, "rank_states": 0, "arena_bytes": 0}
    try:
        jax.block_until_ready(run_ag(shards))
    except Exception as e:  # noqa: BLE001 - the refusal is the point
        assert "tide_xla.release" in str(e), e
    else:
        raise AssertionError("a TIDE call after tide_xla.release ran")
    tide_xla.init(mesh, "fsdp", topology=topology, timeout_s=20.0)
    again = jax.jit(jax.shard_map(lambda s: gathered(s), mesh=mesh, in_specs=(specs,), out_specs=stacked))(shards)
    for k, x in again.items():
        for a, b in zip(x.addressable_shards, results["ag"][k].addressable_shards):
            assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), k
    tide_xla.release(mesh, "fsdp")


def _checkpoint(jax, jnp, np, tide_xla, mesh):
    """Train, save / restore with orbax (docs/xla.md, "Checkpoints and export")."""
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import PartitionSpec as P
    tide_xla.init(mesh, "fsdp", timeout_s=20.0)
    rng = np.random.default_rng(7)
    shapes = {"a": (37, 8), "b": (16,), "c": (5, 3)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    if case == "ckpt_restore":  # other values: the restore must overwrite every byte
        params = {k: np.full(s, 3.0, np.float32) for k, s in shapes.items()}
    shards, layout = tide_xla.shard(params, mesh, "fsdp")
    tx = optax.adamw(1e-2, weight_decay=0.1)
    # optax's scalars (Adam's count) on the whole mesh: a restore places them where the target has
    # them, and a jit of the step needs them on the shards' devices.
    rep = jax.sharding.NamedSharding(mesh, P())
    opt = jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, rep), tx.init(shards))

    def local_loss(s):
        full = tide_xla.gather(s, layout)
        r = jax.lax.axis_index("fsdp").astype(jnp.float32) + 1.0
        return sum(jnp.sum(jnp.sin(v.astype(jnp.float32)) * r) for v in full.values())

    grad = jax.shard_map(jax.grad(local_loss), mesh=mesh, in_specs=(layout.specs,), out_specs=layout.specs)

    @jax.jit
    def step(s, o):
        updates, o = tx.update(grad(s), o, s)
        return optax.apply_updates(s, updates), o

    path = os.path.join(os.environ["CKPT_DIR"], "ckpt")
    ckpt = ocp.StandardCheckpointer()
    if case == "ckpt_save":
        for _ in range(2):
            shards, opt = step(shards, opt)
        ckpt.save(path, {"shards": shards, "opt": opt},
                  custom_metadata=tide_xla.checkpoint_metadata(layout))
        ckpt.wait_until_finished()
    else:  # the targets give shapes and shardings on this mesh; the leaf shapes are checked,
        # then strict=False pads/truncates dim 0 (tide_xla.restore)
        got = tide_xla.restore(ckpt, path, {"shards": shards, "opt": opt}, layout)
        shards, opt = got["shards"], got["opt"]
    out = {}
    for name, tree in (("params", shards), ("mu", opt[0].mu), ("nu", opt[0].nu)):
        for k, x in tide_xla.unshard(tree, layout).items():
            out[f"u/{name}/{k}"] = np.asarray(x.addressable_data(0)).view(np.uint8)
        for k, x in tree.items():  # padding rows: zero (FSDP2's), whatever the process count
            pad = np.asarray(jax.jit(lambda v: jax.sharding.reshard(v, rep))(x).addressable_data(0))[shapes[k][0]:]
            assert not pad.any(), (name, k, pad)
    out["u/count"] = np.asarray(opt[0].count.addressable_data(0)).reshape(1).view(np.uint8)
    shards, opt = step(shards, opt)
    for k, x in shards.items():
        for s in x.addressable_shards:
            out[f"next/{k}/{s.index[0].start or 0}"] = np.asarray(s.data).view(np.uint8)
    tide_xla.release(mesh, "fsdp")
    return out


def _die(jax, jnp, np, tide_xla, mesh):
    """The last process dies at one step of the cross-process set-up or inside the step; the
    others must raise within their deadline naming it."""
    from jax.experimental import io_callback
    from jax.sharding import PartitionSpec as P
    from tide_xla import processes
    last = me == nproc - 1

    def dead(*_):
        os._exit(3)

    if last and case == "die_at_agreement":
        processes._exchange = dead
    at = {"die_at_segments": "open_rank", "die_at_rail": "connect_cuda_rank"}.get(case)
    if last and at:  # CPU: before mapping the peers' segments; CUDA: after the handles, before the rail
        ffi = processes.ffi_module()
        processes.ffi_module = lambda: type("Dying", (), {"__getattr__": lambda _, n: dead if n == at
                                                          else getattr(ffi, n)})()
    tide_xla.init(mesh, "fsdp", topology=topology, timeout_s=3.0)
    global started
    started = time.monotonic()
    rng = np.random.default_rng(7)
    sa, la = tide_xla.shard({"a": rng.standard_normal((37, 8)).astype(np.float32)}, mesh, "fsdp")
    sb, lb = tide_xla.shard({"b": rng.standard_normal((16,)).astype(np.float32)}, mesh, "fsdp")

    def step(sa, sb):
        fa = tide_xla.gather(sa, la)["a"]
        if case == "die_mid_step":  # after the first TIDE call, before the second (data-dependent)
            x = io_callback(lambda v: (dead() if last else np.float32(0)), jax.ShapeDtypeStruct((), jnp.float32),
                            jnp.sum(fa.astype(jnp.float32)))
            sb = {"b": sb["b"] + 0 * x}
        fb = tide_xla.gather(sb, lb)["b"]
        return fa[None], fb[None]

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(la.specs, lb.specs), out_specs=(P("fsdp"), P("fsdp"))))
    jax.block_until_ready(fn(sa, sb))
    return {}


try:
    res = main()
    import numpy as np
    np.savez(os.path.join(out_dir, f"p{me}.npz"), **res)
except BaseException:  # noqa: BLE001 - the test reads the text
    with open(os.path.join(out_dir, f"p{me}.err"), "w") as f:
        f.write(traceback.format_exc())
        if case.startswith("die_"):  # a survivor: how long it took, then no jax.distributed shutdown
            f.write(f"\n[raised {time.monotonic() - started:.1f} s after tide_xla.init]\n")
    if case.startswith("die_"):  # (its barrier would wait for the dead process)
        os._exit(1)
    sys.exit(1)
