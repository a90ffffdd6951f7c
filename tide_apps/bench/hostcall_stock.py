"""Stock FSDP2's host time per call, measured beside TIDE's by ``tide bench hostcall``.

The group is a real ``fully_shard``'ed module whose parameters have the group's shapes (fp32
masters, ``MixedPrecisionPolicy(bf16, fp32)``, as TIDE's column runs it), child of a parameter-free
root, so its FSDPParamGroup is an ordinary non-root group. After one warm-up forward and backward
(FSDP2's lazy init, NCCL's communicator), each sample drives the group's own runtime calls
(``unshard`` + ``wait_for_unshard``; ``post_backward`` with the unsharded gradients set) and times
FSDP2's collective functions inside them, patched in ``_fsdp_param_group``'s namespace (which
imports them by name) with a wall-clock wrapper:

- all-gather: ``foreach_all_gather`` (the bf16 cast, ``all_gather_copy_in``, the
  ``all_gather_into_tensor`` launch) + ``foreach_all_gather_copy_out`` (the output allocation and
  ``split_with_sizes_copy``);
- reduce-scatter: ``foreach_reduce`` (``chunk_cat`` into the fp32 input, the
  ``reduce_scatter_tensor`` launch, the post-reduce views and the sharded gradients' DTensors).

The samples meet TIDE's column's conditions: the device is synchronized and the ranks meet on a
barrier before each call, nothing inside the timed span synchronizes (on CUDA; gloo on CPU
completes its collectives inside the call), and each sample starts with no gradient to accumulate
into. The functions' own signatures differ between torch releases; the param group's calls do not.
"""
from __future__ import annotations

import time
from typing import Callable

_TIMED = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")


def _group_module(shapes: list[tuple[int, ...]]):
    """A module with parameters of the group's shapes whose forward touches every one of them
    (torch is imported here: tide_apps' benches load no framework until they run)."""
    import torch
    from torch import nn

    class Group(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.params = nn.ParameterList(nn.Parameter(torch.empty(s)) for s in shapes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * sum(p.sum() for p in self.params)

    return Group()


def measure(shapes: list[tuple[int, ...]], device, group, iters: int,
            sync: Callable[[], None], barrier: Callable[[], None]) -> dict:
    """Seconds per call, ``iters + 1`` samples each (the first one first): {"ag": [...], "rs": [...],
    "grad_dtype": the unsharded gradients' dtype}. ``device``: a torch.device;
    ``group``: the process group FSDP2 shards over (NCCL on CUDA, gloo on CPU)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    mesh = DeviceMesh.from_group(group, device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        block = _group_module(shapes)
        root = nn.Sequential(block)
    fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    root.to_empty(device=device)
    with torch.no_grad():
        for p in root.parameters():
            p.to_local().normal_()
    root(torch.ones((), device=device)).backward()  # lazy init, communicators
    sync()
    pg = fully_shard.state(block)._fsdp_param_group

    spans: dict[str, float] = {}
    originals = {name: getattr(fpg, name) for name in _TIMED}

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[name] = spans.get(name, 0.0) + time.perf_counter() - t0
        return call

    def sample(calls: Callable[[], None], names: tuple[str, ...]) -> float:
        sync()
        barrier()
        spans.clear()
        calls()
        if sorted(spans) != sorted(names):  # FSDP2 skipped a collective: no figure to report
            raise RuntimeError(f"stock FSDP2 ran {sorted(spans)}, expected {sorted(names)}")
        return sum(spans.values())

    def reduce() -> None:
        pg.post_backward()

    times: dict = {"ag": [], "rs": []}
    for name, fn in originals.items():
        setattr(fpg, name, timed(name, fn))
    try:
        for _ in range(iters + 1):
            times["ag"].append(sample(lambda: (pg.unshard(), pg.wait_for_unshard()), _TIMED[:2]))
            sync()
            pg.reshard()
        # The gradients' unsharded parameters stay gathered across the reduce-scatter samples
        # (one all-gather, not one per sample: on emulated hosts NCCL carries it over sockets).
        pg.unshard()
        pg.wait_for_unshard()
        pg.reshard_after_backward = False
        grads = [torch.randn(fp.unsharded_param.shape, device=device).to(
            # what autograd leaves there: bf16, or the reduce dtype where torch declares the
            # unsharded parameter's grad_dtype (newer FSDP2 upcasts on accumulation)
            getattr(fp.unsharded_param, "grad_dtype", None) or fp.unsharded_param.dtype)
            for fp in pg.fsdp_params]
        for _ in range(iters + 1):
            for fp, g in zip(pg.fsdp_params, grads):
                fp.unsharded_param.grad = g
                fp.sharded_param.grad = None
            times["rs"].append(sample(reduce, _TIMED[2:]))
            sync()
            pg._training_state = TrainingState.IDLE
        pg.reshard_after_backward = True
        pg.reshard()
    finally:
        for name, fn in originals.items():
            setattr(fpg, name, fn)
        sync()
    times["grad_dtype"] = str(grads[0].dtype).removeprefix("torch.")
    return times
