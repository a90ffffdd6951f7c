"""FSDP2's all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) served by TIDE.

[Note: all-gather extensions]
A parameter whose local tensor implements FSDP2's extension protocol (torchao's Float8 weights,
FSDP2's own tests' subclasses) does not all-gather its shard: ``fsdp_pre_all_gather`` turns the
shard into one or more *all-gather inputs* (fp8 data, scales, a bf16 copy; any count, any item size
including 1 byte) plus metadata, and ``fsdp_post_all_gather`` builds the unsharded parameter from
the gathered *outputs* (with ``out=`` after the first time). Both forms of the pre-all-gather are
accepted, ``(mesh)`` (torchao 0.18) and ``(mesh, outer_size, outer_stride, module, mp_policy)``;
FSDP2 picks the form and TIDE calls it through FSDP2 (``FSDPParam.all_gather_inputs``).

TIDE plans such a group with one AG *item* per pre-all-gather output: item (p, j) is output j of
parameter p, planned as a parameter of N s_0 rows (s its per-rank shape) in its item size (1-byte
items as "uint8": float8 data moves as bytes, so gloo's lack of float8 does not matter), never
adopted and never cast: the AG reads the output where the pre-all-gather left it (a user buffer,
as a post-forward re-gather does) and lands rank r's rows at landing(item, r) (Eq. 2) in the
group's ring slot. Those landing views are the FSDPParam's ``all_gather_outputs``, which FSDP2
hands to ``fsdp_post_all_gather`` (as its inputs, and ``out=`` the unsharded parameter it built
the first time): no copy-out, no ``all_gather_copy_in``. Plain parameters of the same group stay
one item each (adopted or cast as always), and chunks are the items' dtype classes
(groups.py [Note: chunks]), extension items in chunks of their own.

The item shapes come from one pre-all-gather call per extension parameter at ``enable()`` (its
outputs' shapes and dtypes; a pre-all-gather with collectives inside, e.g. torchao's dynamic
amax all-reduce, runs on every rank in the same group order there). Each all-gather checks its
outputs against the plan and hands a call that differs to stock FSDP2.

The reduce-scatter is over the original parameters: gradients of the unsharded parameters
(bf16 under a bf16 policy) reduce through TIDE-RS into fp32 shards, planned per dtype class of
the parameters' RS items (``TideGroup.rs_chunks``; reduce_scatter.py [Note: RS parts]). An
extension parameter is sharded on dim 0 (FSDP2's protocol has no Shard(k > 0) form here).

Lifetimes. The unsharded parameter (or its inner tensors, ``_unsharded_inner_tensors``) may alias
the landing views (torchao wraps the gathered fp8 data) or be storage of its own (a dequantized
copy). The per-instance ``free_unsharded_param`` frees only the latter (arena storage keeps its
size, the slot is released logically); torch 2.15's ``free_all_gather_outputs``, called right
after the post-all-gather when the extension answers
``fsdp_should_release_all_gather_outputs_after_post_all_gather()``, is a no-op per instance: the
landing belongs to the ring slot until the group reshards. Not served (one log line): a
pre-all-gather whose outputs are tensor subclasses or 8-byte items, an unevenly dim-0-sharded
parameter with the 1-argument form (its outputs are unpadded, so ranks' sizes differ and stock's
all-gather fails too), a single-rank job, ``reshard_after_forward=<int>`` re-gathers (FSDP2 has
no post-forward form of the protocol; handed back, counted).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from tide_torch import _patches

# Item sizes TIDE moves without a cast; a 1-byte item is "uint8" (float8 data as bytes).
_TWO_BYTE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def item_name(dtype: torch.dtype) -> str | None:
    """The plan dtype of an output item of ``dtype`` (None: not an item size TIDE moves)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size == 1:
        return "uint8"
    if size == 2:
        return _TWO_BYTE.get(dtype, "bfloat16")
    if size == 4:
        return "float32"
    return None


def has_extension(fp: Any) -> bool:
    return hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")


def _arity(fp: Any) -> int:
    try:
        return len(inspect.signature(fp._sharded_local_tensor.fsdp_pre_all_gather).parameters)
    except (TypeError, ValueError):
        return -1


def probe(fp: Any, world: int) -> tuple[list[tuple[int, ...]], list[torch.dtype]] | str:
    """One pre-all-gather of ``fp`` (through FSDP2): its outputs' unsharded item shapes
    (N s_0 rows) and dtypes, or why the parameter cannot be served."""
    if fp.fsdp_placement.dim != 0:
        return f"fsdp_pre_all_gather with Shard({fp.fsdp_placement.dim})"
    if _arity(fp) == 1 and fp._orig_size[0] % world:
        return ("uneven dim-0 shard with the 1-argument fsdp_pre_all_gather (its outputs are "
                "unpadded: ranks' all-gather sizes differ)")
    tensors = fp.all_gather_inputs  # FSDP2 runs the pre-all-gather, records the output sizes
    sizes = list(fp._extensions_data.all_gather_input_sizes)
    fp._extensions_data.clear()  # the metadata is the next all-gather's business
    shapes, dtypes = [], []
    for s, t in zip(sizes, tensors):
        if type(t) is not torch.Tensor:
            return f"fsdp_pre_all_gather returned a {type(t).__name__} (TIDE gathers plain tensors)"
        if item_name(t.dtype) is None:
            return f"fsdp_pre_all_gather returned {t.dtype} (TIDE gathers 1-, 2- and 4-byte items)"
        s = tuple(s)
        shapes.append((world * s[0], *s[1:]) if s else (world,))
        dtypes.append(t.dtype)
    return shapes, dtypes


def gather_inputs(tg: Any, p: int, fp: Any) -> list[torch.Tensor] | str:
    """Parameter p's all-gather inputs for this call (its pre-all-gather outputs, flat), or why
    they differ from the plan."""
    tensors = fp.all_gather_inputs
    items = tg.param_items[p]
    if len(tensors) != len(items):
        return f"{tg.names[p]}: fsdp_pre_all_gather returned {len(tensors)} outputs, planned {len(items)}"
    for i, t in zip(items, tensors):
        if t.dtype != tg.item_dtypes[i] or t.numel() != tg.elements[i]:
            return (f"{tg.names[p]}: fsdp_pre_all_gather output {t.dtype}[{t.numel()}], planned "
                    f"{tg.item_dtypes[i]}[{tg.elements[i]}]")
    return list(tensors)


def in_arena(t: torch.Tensor, arena: Any) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return arena.base_ptr <= ptr < arena.base_ptr + arena.nbytes


def free_inner_tensors(fp: Any, arena: Any) -> None:
    """Frees the extension's own unsharded storage, as FSDP2 does; tensors over the arena's
    landing (the gathered outputs themselves) keep theirs."""
    free = getattr(_patches._param, "free_storage", None)
    for t in getattr(fp, "_unsharded_inner_tensors", ()):
        if not in_arena(t, arena) and free is not None:
            free(t)
