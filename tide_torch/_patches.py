"""Everything tied to FSDP2's internals, resolved per installed torch by signature and attribute.

TIDE meets FSDP2 at these points (see ``shared/reference/fsdp2.md``):

- ``_fsdp_param_group.foreach_all_gather``: patched in the param-group module's namespace,
  because ``_fsdp_param_group`` imports it by name. The TIDE all-gather lands shards in the
  unsharded parameters' storage.
- The all-gather copy-out, which for a TIDE result only waits. Where FSDP2 has a per-group
  copy-out seam (``FSDPParamGroup._all_gather_output_fn``, handed to
  ``foreach_all_gather_copy_out(..., all_gather_output_fn=...)``; torch 2.15) TIDE sets it on the
  groups it serves; otherwise ``_fsdp_param_group.foreach_all_gather_copy_out`` is patched.
- ``_fsdp_collectives.foreach_reduce_scatter_copy_in``: looked up at call time by
  ``foreach_reduce``; TIDE keeps the per-parameter gradients instead of packing them. And
  ``_fsdp_param_group.foreach_reduce`` (imported there by name), wrapped only to tell a TIDE
  group's comm which parameters the call reduces (reduce_scatter.py, [Note: RS parts]).
- ``FSDPParam.free_unsharded_param`` (and at world 1 ``init_all_gather_outputs``): patched per
  *instance*, because an unsharded parameter that lives in an arena ring slot must not have its
  storage resized.

[Note: one adapter, several FSDP2 revisions]
Nothing here compares version strings. Each function TIDE patches, calls or relies on is
checked against the parameter lists of the FSDP2 revisions tide_torch is written for
(``_SIGNATURES``: 2.11 through 2.15), and a feature is chosen by what the installed FSDP2 has:
the copy-out seam above; ``_fsdp_param_groups`` (several param groups per module, 2.12+) or
``_fsdp_param_group``; the mixed-precision policy per parameter (``FSDPParam.mp_policy``, every
revision; 2.15 dropped the group's copy); FSDP2's compiled-autograd switch where it exists (2.11:
FSDP2 then runs a traceable path TIDE leaves to stock; 2.12+ runs its hooks eagerly under
``torch._dynamo.disable`` and has no such path). ``import tide_torch`` never fails on these
internals: what is missing or differs is collected here and raised as a
``TideTorchVersionError`` naming the function or attribute at ``enable()``, before anything is
patched. ``set_all_gather_layout`` (pytorch#188276) is reported where the installed torch has it
(no release has it yet).
"""
from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "AllGatherResult", "FSDPParamGroup", "ReduceScatter", "ShardedState", "TrainingState",
    "TideTorchVersionError", "check_group", "check_torch", "compiled_autograd_enabled",
    "copy_out_seam", "has_all_gather_layout", "install", "param_groups", "require_supported_torch",
    "set_copy_out", "uninstall",
]

_FSDP = "torch.distributed.fsdp._fully_shard"


class TideTorchVersionError(RuntimeError):
    """The installed torch's FSDP2 internals differ from what tide_torch was written against."""


_import_problems: list[str] = []


def _module(name: str) -> Any:
    try:
        return importlib.import_module(f"{_FSDP}.{name}")
    except Exception as e:  # noqa: BLE001 - reported at enable(), never at import
        _import_problems.append(f"{_FSDP}.{name} cannot be imported ({type(e).__name__}: {e})")
        return None


_api = _module("_fsdp_api")
_coll = _module("_fsdp_collectives")
_common = _module("_fsdp_common")
_param = _module("_fsdp_param")
_pg = _module("_fsdp_param_group")


class _Unavailable:
    """Stands in for an FSDP2 class this torch lacks; enable() has refused before any use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TideTorchVersionError("tide_torch: " + "; ".join(check_torch()))


def _attr(owner: Any, name: str) -> Any:
    return getattr(owner, name, None) if owner is not None else None


AllGatherResult = _attr(_coll, "AllGatherResult") or _Unavailable
FSDPParam = _attr(_param, "FSDPParam")
FSDPParamGroup = _attr(_pg, "FSDPParamGroup")
ShardedState = _attr(_param, "ShardedState")
TrainingState = _attr(_common, "TrainingState")
ReduceScatter = _attr(_api, "ReduceScatter") or _Unavailable

# Parameter lists per function, one entry per FSDP2 revision that tide_torch handles.
_AG = ("fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream",
       "device", "all_gather_comm")
_COPY_OUT = ("all_gather_result", "fsdp_params", "group")
_COPY_OUT_SEAM = _COPY_OUT + ("all_gather_output_fn",)
_REDUCE_211 = ("fsdp_params", "unsharded_grads", "reduce_scatter_group", "reduce_scatter_stream",
               "reduce_scatter_comm", "orig_dtype", "reduce_dtype", "device",
               "gradient_divide_factor", "all_reduce_group", "all_reduce_stream",
               "all_reduce_grads", "partial_reduce_output", "all_reduce_hook",
               "force_sum_reduction_for_comms")
_REDUCE_215 = tuple(n for n in _REDUCE_211 if n != "orig_dtype") + (
    "prepare_reduce_scatter_inputs",)
_INIT_OUTPUTS = ("self", "all_gather_input_numels", "all_gather_input_dtypes", "world_size",
                 "device")
_SIGNATURES: dict[tuple[Any, str], tuple[tuple[str, ...], ...]] = {
    (_pg, "foreach_all_gather"): (_AG,),
    (_pg, "foreach_reduce"): (_REDUCE_211, _REDUCE_215),
    (_pg, "foreach_all_gather_copy_out"): (_COPY_OUT, _COPY_OUT_SEAM),
    (_coll, "foreach_reduce_scatter_copy_in"): (
        ("unsharded_grads", "reduce_scatter_input", "world_size"),),
    (_coll, "foreach_reduce"): (_REDUCE_211, _REDUCE_215),
    (FSDPParam, "free_unsharded_param"): (("self",),),
    (FSDPParam, "init_unsharded_param"): (("self",),),
    (FSDPParam, "init_all_gather_outputs"): (_INIT_OUTPUTS + ("force_recreate",), _INIT_OUTPUTS),
}
_SEAM_FN = ("fsdp_params", "all_gather_result", "world_size")
_RESULT_FIELDS = ("all_gather_output", "all_gather_event", "all_gather_work",
                  "param_all_gather_input_dtypes", "param_all_gather_input_numels",
                  "all_gather_input_split_sizes")
_GROUP_ATTRS = ("fsdp_params", "_all_gather_comm", "_reduce_scatter_comm", "mesh_info",
                "post_forward_mesh_info", "offload_policy", "reshard_after_backward",
                "gradient_divide_factor", "_training_state", "_all_gather_result")
_PARAM_ATTRS = ("mp_policy",)

# The stock functions, captured at import so that disable() always restores the real ones.
_STOCK: dict[tuple[Any, str], Callable] = {
    key: fn for key in ((_pg, "foreach_all_gather"), (_pg, "foreach_all_gather_copy_out"),
                        (_pg, "foreach_reduce"), (_coll, "foreach_reduce_scatter_copy_in"))
    if (fn := _attr(key[0], key[1])) is not None}


def _qualname(owner: Any, name: str) -> str:
    if owner is None:
        return f"{_FSDP}.?.{name}"
    mod = owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"
    return f"{mod}.{name}"


def _parameters(fn: Callable) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def copy_out_seam() -> bool:
    """Whether FSDP2 hands each group's copy-out to ``FSDPParamGroup._all_gather_output_fn``."""
    fn = _STOCK.get((_pg, "foreach_all_gather_copy_out"))
    return fn is not None and _parameters(fn) == _COPY_OUT_SEAM


def check_torch() -> list[str]:
    """Returns the problems found (empty: this torch is supported). Never raises."""
    problems = list(_import_problems)
    for (owner, name), accepted in _SIGNATURES.items():
        fn = _attr(owner, name)
        if fn is None:
            problems.append(f"{_qualname(owner, name)} is missing")
            continue
        if getattr(fn, "_tide_hook", False):  # ours: check what it replaced
            fn = _STOCK[(owner, name)]
        got = _parameters(fn)
        if got not in accepted:
            problems.append(f"{_qualname(owner, name)}{got} differs from every expected form "
                            f"{' or '.join(map(str, accepted))}")
    for owner, name in ((_coll, "AllGatherResult"), (_api, "ReduceScatter"),
                        (_param, "ShardedState"), (_common, "TrainingState"),
                        (_pg, "FSDPParamGroup")):
        if _attr(owner, name) is None:
            problems.append(f"{_qualname(owner, name)} is missing")
    fields = tuple(getattr(AllGatherResult, "_fields", ()))
    if AllGatherResult is not _Unavailable and fields != _RESULT_FIELDS:
        problems.append(f"{_qualname(_coll, 'AllGatherResult')} fields {fields} differ from "
                        f"{_RESULT_FIELDS}")
    if copy_out_seam():
        fn = _attr(_coll, "_default_all_gather_output_fn")
        if fn is None or _parameters(fn) != _SEAM_FN:
            problems.append(f"{_qualname(_coll, '_default_all_gather_output_fn')} "
                            f"{'is missing' if fn is None else _parameters(fn)} (copy-out seam "
                            f"expects {_SEAM_FN})")
    reduce = _attr(_coll, "foreach_reduce")
    if reduce is not None:
        try:
            src = inspect.getsource(reduce)
        except (OSError, TypeError):
            src = ""
        if "foreach_reduce_scatter_copy_in(" not in src or "reduce_scatter_comm.allocate(" not in src:
            problems.append(f"{_qualname(_coll, 'foreach_reduce')} no longer packs through "
                            "foreach_reduce_scatter_copy_in / reduce_scatter_comm.allocate")
    return problems


def require_supported_torch() -> None:
    problems = check_torch()
    if problems:
        raise TideTorchVersionError(
            f"tide_torch does not support the installed torch {torch.__version__}: "
            + "; ".join(problems) + ". Supported: torch 2.11 to 2.15 (README); or update "
            "tide_torch/_patches.py.")


def check_group(pg: Any) -> list[str]:
    missing = [f"FSDPParamGroup.{a} is missing" for a in _GROUP_ATTRS if not hasattr(pg, a)]
    if copy_out_seam() and not hasattr(pg, "_all_gather_output_fn"):
        missing.append("FSDPParamGroup._all_gather_output_fn is missing")
    for fp in getattr(pg, "fsdp_params", ()):
        missing += [f"FSDPParam.{a} is missing" for a in _PARAM_ATTRS if not hasattr(fp, a)]
        break
    return missing


def param_groups(state: Any) -> list[Any]:
    """The FSDPParamGroups of one module's FSDPState (several where FSDP2 has them)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    pg = getattr(state, "_fsdp_param_group", None)
    return [pg] if pg is not None else []


def has_all_gather_layout() -> bool:
    """Whether this torch has FSDPModule.set_all_gather_layout (pytorch#188276)."""
    from torch.distributed.fsdp import FSDPModule
    return hasattr(FSDPModule, "set_all_gather_layout")


_fsdp_compiled_autograd = _attr(_common, "compiled_autograd_enabled")


def compiled_autograd_enabled() -> bool:
    """FSDP2's own switch where it has one; see [Note: one adapter, several FSDP2 revisions]."""
    return bool(_fsdp_compiled_autograd()) if _fsdp_compiled_autograd is not None else False


# ------------------------------------------------------------------------------------------------
# Installation: module-level patches are shared by every enabled model (refcounted); dispatch to
# TIDE happens per call through the hooks' own registries, and everything else goes to stock.
# ------------------------------------------------------------------------------------------------
_lock = threading.Lock()
_refcount = 0


def stock(owner: Any, name: str) -> Callable:
    return _STOCK[(owner, name)]


def _module_patches(all_gather: Callable, copy_out: Callable, reduce: Callable,
                    rs_copy_in: Callable) -> dict[tuple[Any, str], Callable]:
    patches = {(_pg, "foreach_all_gather"): all_gather, (_pg, "foreach_reduce"): reduce,
               (_coll, "foreach_reduce_scatter_copy_in"): rs_copy_in}
    if not copy_out_seam():
        patches[(_pg, "foreach_all_gather_copy_out")] = copy_out
    return patches


_installed: dict[tuple[Any, str], Callable] = {}


def install(all_gather: Callable, copy_out: Callable, reduce: Callable,
            rs_copy_in: Callable) -> None:
    """Patches the module-level functions (the copy-out only where FSDP2 has no per-group seam:
    there ``set_copy_out`` serves each group)."""
    global _refcount
    with _lock:
        if _refcount == 0:
            patches = _module_patches(all_gather, copy_out, reduce, rs_copy_in)
            for (owner, name) in patches:
                if getattr(owner, name) is not _STOCK[(owner, name)]:
                    raise TideTorchVersionError(
                        f"{_qualname(owner, name)} is already patched by someone else; "
                        "tide_torch will not stack patches")
            for (owner, name), fn in patches.items():
                setattr(owner, name, fn)
            _installed.update(patches)
        _refcount += 1


def uninstall() -> None:
    global _refcount
    with _lock:
        if _refcount == 0:
            return
        _refcount -= 1
        if _refcount == 0:
            for (owner, name) in _installed:
                setattr(owner, name, _STOCK[(owner, name)])
            _installed.clear()


def installed() -> bool:
    return _refcount > 0


def set_copy_out(pg: Any, fn: Callable | None) -> Callable | None:
    """Sets ``pg``'s copy-out seam to ``fn`` (None: FSDP2's default); returns the previous one.
    A no-op returning None where FSDP2 has no seam (the module-level patch serves instead)."""
    if not copy_out_seam():
        return None
    previous = pg._all_gather_output_fn
    pg._all_gather_output_fn = fn if fn is not None else _coll._default_all_gather_output_fn
    return previous


def default_copy_out() -> Callable:
    """FSDP2's own copy-out function behind the seam (``_default_all_gather_output_fn``)."""
    return _coll._default_all_gather_output_fn


def patch_param_free(fsdp_param: Any, fn: Callable) -> None:
    """Per-instance override of FSDPParam.free_unsharded_param, and of free_all_gather_outputs
    where FSDP2 has it (torch 2.15 calls it right after an extension's post-all-gather): the
    landing's arena storage is never freed (undone by unpatch_param_free)."""
    fsdp_param.free_unsharded_param = fn
    if hasattr(type(fsdp_param), "free_all_gather_outputs"):
        fsdp_param.free_all_gather_outputs = _keep_all_gather_outputs


def _keep_all_gather_outputs() -> None:
    """The landing belongs to the group's ring slot until the group reshards (runtime.py)."""


def unpatch_param_free(fsdp_param: Any) -> None:
    fsdp_param.__dict__.pop("free_unsharded_param", None)
    fsdp_param.__dict__.pop("free_all_gather_outputs", None)
    fsdp_param.__dict__.pop("init_all_gather_outputs", None)


def patch_param_init_outputs(fsdp_param: Any, fn: Callable) -> None:
    """Per-instance override of FSDPParam.init_all_gather_outputs (world 1; undone by
    unpatch_param_free)."""
    fsdp_param.init_all_gather_outputs = fn


def preserve_version_counter(tensors: tuple[torch.Tensor, ...]):
    """Landing writes into autograd-visible storage without bumping its version counter."""
    return torch.autograd._unsafe_preserve_version_counter(tensors)
