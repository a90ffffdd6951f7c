"""The one place where tide_torch moves bytes between ranks: calls into TIDE's executors.

The adapter hands the transport per-parameter tensors whose addresses the plan fixed:

- ``all_gather(tg, inputs, landings)``: ``inputs[p]`` is this rank's packed-shard slice of
  parameter p (stage slot or adopted resident shard), ``landings[p]`` the parameter's padded
  unsharded buffer (``N * e_p`` items at arena offset ``landing(p, 0)``). Afterwards every rank's
  shard r of p sits at ``landing(p, r)`` (Eq. 2): no copy-out.
- ``reduce_scatter(tg, grads, output, alpha)``: ``grads[p]`` is parameter p's unpadded gradient
  (autograd's tensor for In-Place, the vacated ring slot for Slot-Reuse); ``output`` is FSDP2's
  fp32 reduce-scatter output, whose ``as_strided`` views at ``o32_p`` are the sharded grads.
  ``output = alpha * sum_r grads_r`` over this rank's rows, padding rows contributing zero.

Executors
  TIDE's CPU executor runs ranks as processes over POSIX shared memory: each rank's arena is a
  named segment (``Arena.shm_name``, exchanged at enable time), a rank reads only its own buffers
  and pushes into peers' arenas. The binding that runs a compiled TIDE-AG / TIDE-RS program in
  that mode is looked up on ``tide._core`` (see ``_executor_api``); see the report for the exact
  entry points needed.

  Until the executor binding exists in this build, ``InterimTransport`` keeps the adapter's
  contract (same landings, same output layout, same alpha) over torch.distributed per-parameter
  collectives, so everything above this module — patches, landings, zero-copy views, RS into
  FSDP2's output — is exercised end to end. It is not TIDE's transport and logs so once.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist

import tide

logger = logging.getLogger("tide_torch")


class Transport(Protocol):
    name: str

    def all_gather(self, tg: Any, inputs: list[torch.Tensor],
                   landings: list[torch.Tensor]) -> None: ...

    def reduce_scatter(self, tg: Any, grads: list[torch.Tensor], output: torch.Tensor,
                       alpha: float) -> None: ...


def _executor_api() -> Any | None:
    """TIDE's process-mode executor binding, when this build of tide._core has one."""
    core = tide._core
    for name in ("ProcessExecutor", "ShmExecutor"):
        if hasattr(core, name):
            return getattr(core, name)
    return None


class ExecutorTransport:
    """Runs TIDE programs through tide._core's process-mode executor (CPU) / CUDA executor."""

    name = "tide-executor"

    def __init__(self, api: Any, arena: Any, peers: list[str], rank: int, topo: tide.Topology):
        self._exec = api(arena.shm_name, peers, rank, topo.nodes, topo.gpus_per_node)

    def all_gather(self, tg, inputs, landings):
        self._exec.all_gather(tg.plan, [t.data_ptr() for t in inputs],
                              [t.data_ptr() for t in landings])

    def reduce_scatter(self, tg, grads, output, alpha):
        self._exec.reduce_scatter(tg.plan, [g.data_ptr() for g in grads], output.data_ptr(),
                                  float(alpha))


class InterimTransport:
    """Stand-in for the executor: per-parameter torch.distributed collectives with the adapter's
    addressing (lands directly; reduces each parameter into its slice of FSDP2's output)."""

    name = "interim-torch-distributed"

    def __init__(self, group_of: Any):
        self._group_of = group_of  # tg -> shard ProcessGroup

    def all_gather(self, tg, inputs, landings):
        group = self._group_of(tg)
        for inp, out in zip(inputs, landings):
            dist.all_gather_into_tensor(out, inp, group=group)

    def reduce_scatter(self, tg, grads, output, alpha):
        group = self._group_of(tg)
        layout = tg.plan.layout
        N = layout.N
        for p, grad in enumerate(grads):
            pl = layout.params[p]
            full = torch.zeros(N * pl.e, dtype=output.dtype, device=output.device)
            full[: grad.numel()].copy_(grad.reshape(-1))
            dist.reduce_scatter_tensor(output.narrow(0, pl.o32, pl.e), full,
                                       op=dist.ReduceOp.SUM, group=group)
        if alpha != 1.0:
            output.mul_(alpha)


def make_transport(arena: Any, peers: list[str], rank: int, topo: tide.Topology,
                   group_of: Any) -> Transport:
    api = _executor_api()
    if api is not None and arena.shm_name is not None:
        return ExecutorTransport(api, arena, peers, rank, topo)
    logger.info("tide_torch: this build of tide._core has no process-mode executor binding; "
                "using the interim torch.distributed landing transport")
    return InterimTransport(group_of)
