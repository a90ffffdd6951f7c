"""tide_xla: TIDE's zero-copy collectives for JAX, as XLA FFI custom calls.

Importing tide_xla needs jax, never torch. The training-step pattern (optax, fp32 master shards,
bf16 compute, TIDE-AG forward / TIDE-RS backward):

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    tide_xla.init(mesh, "fsdp")                              # topology, mode, handlers
    graphdef, params = nnx.split(model, nnx.Param)
    shards, layout = tide_xla.shard(params, mesh, "fsdp")    # fp32, dim 0 padded, P("fsdp")
    tx = optax.adamw(1e-3); opt_state = tx.init(shards)

    def local_loss(local_shards, batch):                     # runs per device
        full = tide_xla.gather(local_shards, layout)          # one TIDE-AG per group, bf16
        return loss_fn(nnx.merge(graphdef, full), batch)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(shards, opt_state, batch):
        grads = jax.shard_map(jax.grad(local_loss), mesh=mesh,
                              in_specs=(layout.specs, P("fsdp")), out_specs=layout.specs)(
                                  shards, batch)              # TIDE-RS: bf16 grads -> fp32 shards
        updates, opt_state = tx.update(grads, opt_state, shards)
        return optax.apply_updates(shards, updates), opt_state

The gradient is the sum over ranks of each rank's local-loss gradient (the transpose of
jax.lax.all_gather); pass `gather(..., grad_scale=1/N)` or average the loss for a mean.
For gradient accumulation over micro-batches, take gradients w.r.t. the gathered parameters and
call `acc = reduce_scatter(full_grads, layout, accumulate=acc)` (acc from `zeros_packed(layout)`,
passed in with in_specs P("fsdp") and donated): the packed fp32 shards are accumulated in place
(input_output_aliases); `unpack_grads(acc, layout)` gives the shard tree for the optimizer.

`tide_apps.xla_virtual` runs all N ranks of a topology on one device through these handlers
(operands stacked [N, ...]): tests and one-GPU machines. docs/xla.md describes both paths
(XLA:CPU and CUDA).
"""
from tide_xla.checkpoint import check_checkpoint, checkpoint_metadata, restore
from tide_xla.context import TideContext, arena_bytes, init, live_states, release
from tide_xla.gather import copy_out_bytes, gather, packed_sizes, reduce_scatter, unpack_grads, zeros_packed
from tide_xla.sharding import ShardGroup, ShardLayout, default_group_key, shard, unshard

__all__ = ["ShardGroup", "ShardLayout", "TideContext", "arena_bytes", "check_checkpoint", "checkpoint_metadata",
           "copy_out_bytes", "default_group_key", "gather", "init", "live_states", "restore",
           "packed_sizes", "reduce_scatter", "release", "shard", "unpack_grads", "unshard", "zeros_packed"]
__version__ = "0.1.0"
