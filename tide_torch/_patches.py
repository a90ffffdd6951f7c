"""Everything tied to one torch revision: FSDP2 internals that TIDE patches, signature-checked.

TIDE meets FSDP2 at four points (see ``shared/reference/fsdp2.md``):

- ``_fsdp_param_group.foreach_all_gather`` and ``.foreach_all_gather_copy_out``: patched in the
  param-group module's namespace, because ``_fsdp_param_group`` imports them by name. The TIDE
  all-gather lands shards in the unsharded parameters' storage; the copy-out only waits.
- ``_fsdp_collectives.foreach_reduce_scatter_copy_in``: looked up at call time by
  ``foreach_reduce``; TIDE keeps the per-parameter gradients instead of packing them.
- ``FSDPParam.free_unsharded_param``: patched per *instance* (an attribute on the FSDPParam
  object, removed on disable), because an unsharded parameter that lives in an arena ring slot
  must not have its storage resized.

Every function is checked against the signature this module was written for; a torch whose
functions differ gets a ``TideTorchVersionError`` naming the function, before anything is
patched. ``set_all_gather_layout`` (pytorch#188276) is used only where the installed torch has it.
"""
from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard import _fsdp_param as _param
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _pg
from torch.distributed.fsdp._fully_shard._fsdp_common import compiled_autograd_enabled

__all__ = [
    "AllGatherResult",
    "FSDPParam",
    "FSDPParamGroup",
    "ShardedState",
    "TrainingState",
    "TideTorchVersionError",
    "check_torch",
    "compiled_autograd_enabled",
    "has_all_gather_layout",
    "install",
    "uninstall",
]

AllGatherResult = _coll.AllGatherResult
FSDPParam = _param.FSDPParam
FSDPParamGroup = _pg.FSDPParamGroup
ShardedState = _param.ShardedState
TrainingState = _pg.TrainingState
ReduceScatter = _coll.ReduceScatter
get_gradient_divide_factors = _coll._get_gradient_divide_factors


class TideTorchVersionError(RuntimeError):
    """The installed torch's FSDP2 internals differ from what tide_torch was written against."""


# (module, attribute) -> parameter names this adapter was written against (torch 2.11).
_EXPECTED: dict[tuple[Any, str], tuple[str, ...]] = {
    (_pg, "foreach_all_gather"): (
        "fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream",
        "device", "all_gather_comm"),
    (_pg, "foreach_all_gather_copy_out"): ("all_gather_result", "fsdp_params", "group"),
    (_coll, "foreach_reduce_scatter_copy_in"): (
        "unsharded_grads", "reduce_scatter_input", "world_size"),
    (_coll, "foreach_reduce"): (
        "fsdp_params", "unsharded_grads", "reduce_scatter_group", "reduce_scatter_stream",
        "reduce_scatter_comm", "orig_dtype", "reduce_dtype", "device", "gradient_divide_factor",
        "all_reduce_group", "all_reduce_stream", "all_reduce_grads", "partial_reduce_output",
        "all_reduce_hook", "force_sum_reduction_for_comms"),
    (_coll, "_get_gradient_divide_factors"): (
        "reduce_scatter_group", "all_reduce_group", "reduce_dtype", "device_type", "factor",
        "force_sum_reduction_for_comms"),
    (FSDPParam, "free_unsharded_param"): ("self",),
    (FSDPParam, "init_unsharded_param"): ("self",),
    (FSDPParam, "init_all_gather_outputs"): (
        "self", "all_gather_input_numels", "all_gather_input_dtypes", "world_size", "device",
        "force_recreate"),
}
_EXPECTED_RESULT_FIELDS = (
    "all_gather_output", "all_gather_event", "all_gather_work", "param_all_gather_input_dtypes",
    "param_all_gather_input_numels", "all_gather_input_split_sizes")
_EXPECTED_GROUP_ATTRS = ("fsdp_params", "_all_gather_comm", "_reduce_scatter_comm", "mesh_info",
                         "post_forward_mesh_info", "mp_policy", "offload_policy",
                         "reshard_after_backward", "gradient_divide_factor", "_training_state",
                         "_all_gather_result")

# The stock functions, captured at import so that disable() always restores the real ones.
_STOCK: dict[tuple[Any, str], Callable] = {
    (_pg, "foreach_all_gather"): _pg.foreach_all_gather,
    (_pg, "foreach_all_gather_copy_out"): _pg.foreach_all_gather_copy_out,
    (_coll, "foreach_reduce_scatter_copy_in"): _coll.foreach_reduce_scatter_copy_in,
}


def _qualname(owner: Any, name: str) -> str:
    mod = owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"
    return f"{mod}.{name}"


def check_torch() -> list[str]:
    """Returns the problems found (empty: this torch is supported). Never raises."""
    problems = []
    for (owner, name), params in _EXPECTED.items():
        fn = getattr(owner, name, None)
        if fn is None:
            problems.append(f"{_qualname(owner, name)} is missing")
            continue
        if getattr(fn, "_tide_hook", False):  # ours: check what it replaced
            fn = _STOCK[(owner, name)]
        try:
            got = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            got = ()
        if got != params:
            problems.append(f"{_qualname(owner, name)}{got} differs from the expected {params}")
    if tuple(getattr(AllGatherResult, "_fields", ())) != _EXPECTED_RESULT_FIELDS:
        problems.append(f"{_qualname(_coll, 'AllGatherResult')} fields "
                        f"{getattr(AllGatherResult, '_fields', None)} differ")
    src = inspect.getsource(_coll.foreach_reduce)
    if "foreach_reduce_scatter_copy_in(" not in src or "reduce_scatter_comm.allocate(" not in src:
        problems.append(f"{_qualname(_coll, 'foreach_reduce')} no longer packs through "
                        "foreach_reduce_scatter_copy_in / reduce_scatter_comm.allocate")
    return problems


def require_supported_torch() -> None:
    problems = check_torch()
    if problems:
        raise TideTorchVersionError(
            f"tide_torch does not support the installed torch {torch.__version__}: "
            + "; ".join(problems) + ". Use torch 2.11 or update tide_torch/_patches.py.")


def check_group(pg: Any) -> list[str]:
    return [f"FSDPParamGroup.{a} is missing" for a in _EXPECTED_GROUP_ATTRS if not hasattr(pg, a)]


def has_all_gather_layout() -> bool:
    """Whether this torch has FSDPModule.set_all_gather_layout (pytorch#188276)."""
    from torch.distributed.fsdp import FSDPModule
    return hasattr(FSDPModule, "set_all_gather_layout")


# ------------------------------------------------------------------------------------------------
# Installation: module-level patches are shared by every enabled model (refcounted); dispatch to
# TIDE happens per call through the hooks' own registries, and everything else goes to stock.
# ------------------------------------------------------------------------------------------------
_lock = threading.Lock()
_refcount = 0


def stock(owner: Any, name: str) -> Callable:
    return _STOCK[(owner, name)]


def install(all_gather: Callable, copy_out: Callable, rs_copy_in: Callable) -> None:
    global _refcount
    with _lock:
        if _refcount == 0:
            for (owner, name), fn in _STOCK.items():
                if getattr(owner, name) is not fn:
                    raise TideTorchVersionError(
                        f"{_qualname(owner, name)} is already patched by someone else; "
                        "tide_torch will not stack patches")
            _pg.foreach_all_gather = all_gather
            _pg.foreach_all_gather_copy_out = copy_out
            _coll.foreach_reduce_scatter_copy_in = rs_copy_in
        _refcount += 1


def uninstall() -> None:
    global _refcount
    with _lock:
        if _refcount == 0:
            return
        _refcount -= 1
        if _refcount == 0:
            for (owner, name), fn in _STOCK.items():
                setattr(owner, name, fn)


def installed() -> bool:
    return _refcount > 0


def patch_param_free(fsdp_param: Any, fn: Callable) -> None:
    """Per-instance override of FSDPParam.free_unsharded_param (undone by unpatch_param_free)."""
    fsdp_param.free_unsharded_param = fn


def unpatch_param_free(fsdp_param: Any) -> None:
    fsdp_param.__dict__.pop("free_unsharded_param", None)
    fsdp_param.__dict__.pop("init_all_gather_outputs", None)


def patch_param_init_outputs(fsdp_param: Any, fn: Callable) -> None:
    """Per-instance override of FSDPParam.init_all_gather_outputs (world 1; undone by
    unpatch_param_free)."""
    fsdp_param.init_all_gather_outputs = fn


def is_inference(t: torch.Tensor) -> bool:
    return t.is_inference()


def preserve_version_counter(tensors: tuple[torch.Tensor, ...]):
    """Landing writes into autograd-visible storage without bumping its version counter."""
    return torch.autograd._unsafe_preserve_version_counter(tensors)
