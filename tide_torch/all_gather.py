"""TIDE-AG face for FSDP2: shards land in the unsharded parameters' storage; copy-out only waits.

``foreach_all_gather`` below replaces FSDP2's in the param-group module's namespace (installed by
``_patches.install``). A call for a group TIDE does not serve, or in a state TIDE does not plan
(post-forward resharded mesh, compiled autograd), goes to stock.

For a served group the all-gather input is, per parameter:
- In-place shard adoption (sharded dtype == all-gather dtype, §3.1): the adopted resident shard
  in the arena, read in place (no copy-in);
- mixed precision (fp32 master shards, bf16 or fp16 all-gather): the fp32 shard, which the
  transport casts into its chunk's receive-stage slot instead of FSDP2's fresh copy-in buffer.
A group may mix both, and all-gather dtypes (groups.py [Note: chunks]).
The copy-out is FSDP2's per-group seam where it has one (``copy_out_for``), else the patched
``foreach_all_gather_copy_out``; either only waits for a TIDE result.
The landing buffers are the FSDPParams' ``all_gather_outputs``: zero-offset arena views at the
planned landing addresses, from which FSDP2's own ``init_unsharded_param`` builds the unsharded
parameters once (``as_strided(..., storage_offset=0)``), so they keep those addresses.

A group that moved to storage of its own (placement.py [Note: ring depth]) keeps TIDE-AG where
its all-gather is a pull landing (a cast: comm.py ``pulls``): it lands straight in FSDP2's own
``all_gather_outputs``, allocated and freed as stock does (see [Note: own-storage landing]),
with no copy-out. Without a cast, and for the post-forward re-gather, TIDE-AG pushes into the
peers' landings, which must be arena memory: those calls are handed to stock FSDP2 (counted,
one log line naming why).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import _get_device_handle

from tide_torch import _patches, comm, extensions

# id(FSDPParamGroup.fsdp_params) -> TideGroup. The list object is the group's identity in the
# calls FSDP2 makes to foreach_all_gather / foreach_all_gather_copy_out.
REGISTRY: dict[int, Any] = {}


class TideAllGatherResult(_patches.AllGatherResult):
    """An AllGatherResult whose data already sits in the unsharded parameters."""


def _served(fsdp_params: list, group: Any) -> Any | None:
    tg = REGISTRY.get(id(fsdp_params))
    if tg is None or _patches.compiled_autograd_enabled():
        return None
    states = {fp.sharded_state for fp in fsdp_params}
    post_forward = group.size() != tg.world
    why = None if tg.moved is None else own_storage_stock_reason(tg, post_forward)
    if why is not None:
        tg.runtime.hand_back(tg, "ag", why)
        return None
    if group.size() == tg.world and states == {_patches.ShardedState.SHARDED}:
        return tg
    if (states == {_patches.ShardedState.SHARDED_POST_FORWARD} and tg.post_forward_ranks
            and group.size() == len(tg.post_forward_ranks)):
        return tg  # the re-gather over the post-forward group (groups.py [Note: post-forward mesh])
    why = (f"all-gather over {group.size()} ranks (the post-forward mesh of reshard_after_forward"
           f"=int), planned for {tg.world} ranks only" if group.size() != tg.world
           else f"parameters in states {sorted(map(str, states))}")
    tg.runtime.hand_back(tg, "ag", why)
    return None


@torch.no_grad()
def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream,
                       all_gather_stream, device, all_gather_comm):
    tg = _served(fsdp_params, group)
    if tg is None:
        return _patches.stock(_patches._pg, "foreach_all_gather")(
            fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device,
            all_gather_comm)
    rt = tg.runtime
    handle = _get_device_handle(device.type)
    compute_stream = handle.current_stream()  # FSDP2's: reads the parameters, frees own storage
    post_forward = group.size() != tg.world
    why = None
    with handle.stream(all_gather_copy_in_stream):
        # [Note: ring-slot reuse] The slot this group lands in was last written by the group two
        # positions earlier (or, under Slot-Reuse, holds its gradients until the reduce-scatter
        # has read them). acquire_slot checks that group is resharded and makes this stream wait
        # for the event that released the slot; where tg no longer fits the ring it moves to its
        # own storage instead (placement.py, [Note: ring depth]).
        if tg.moved is None:
            rt.acquire_slot(tg, all_gather_copy_in_stream)
        if tg.moved is not None:
            why = own_storage_stock_reason(tg, post_forward)
        inputs = None if why is not None else (
            [fp._sharded_post_forward_param_data for fp in fsdp_params] if post_forward
            else _all_gather_inputs(tg, all_gather_stream))
        if isinstance(inputs, str):  # pre-all-gather outputs that differ from the plan
            why = inputs
        landings = None if why is not None else (
            tg.landing_views if tg.moved is None
            else own_landings(tg, device, (compute_stream, all_gather_stream)))
    if why is not None:
        rt.hand_back(tg, "ag", why)
        return _patches.stock(_patches._pg, "foreach_all_gather")(
            fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device,
            all_gather_comm)
    all_gather_stream.wait_stream(all_gather_copy_in_stream)
    with handle.stream(all_gather_stream):
        outs = tuple(t for t in landings if not t.is_inference())
        # Landing writes the storage autograd saved for backward; like FSDP2's copy-out it must
        # not bump the version counter.
        if outs:
            with _patches.preserve_version_counter(outs):
                pulled = rt.transport.all_gather(tg, inputs, landings, post_forward)
        else:
            pulled = rt.transport.all_gather(tg, inputs, landings, post_forward)
        rt.stats["ag_pull_chunks"] += pulled
        event = all_gather_stream.record_event()
        rt.stats["ag_tide"] += 1
        rt.stats["ag_post_forward"] += post_forward
        rt.stats["ag_own_storage"] += tg.moved is not None
        # Per parameter, its items' (pre-all-gather outputs') dtypes and numels, as FSDP2's.
        return TideAllGatherResult(
            all_gather_output=landings[0],
            all_gather_event=event,
            all_gather_work=None,
            param_all_gather_input_dtypes=[[tg.item_dtypes[i] for i in its] if ext
                                           else [tg.item_dtypes[its[0]]]
                                           for its, ext in zip(tg.param_items, tg.extension)],
            param_all_gather_input_numels=[[tg.elements[i] for i in its] if ext
                                           else [sum(tg.elements[i] for i in its)]
                                           for its, ext in zip(tg.param_items, tg.extension)],
            all_gather_input_split_sizes=list(tg.elements),
        )


def _all_gather_inputs(tg: Any, all_gather_stream: Any) -> list[torch.Tensor] | str:
    """Per AG item: a plain parameter's adopted resident shard, or (mixed precision: a casting
    chunk) its fp32 master shard, which the transport casts into the chunk's receive-stage slot
    (TIDE-AG's CAST op) instead of FSDP2's fresh copy-in buffer; an extension parameter's
    pre-all-gather outputs, read where they are (extensions.py [Note: all-gather extensions]).
    A string: why this call's pre-all-gather outputs differ from the plan."""
    fsdp_params = tg.pg.fsdp_params
    inputs: list[Any] = [None] * len(tg.items)
    for p, fp in enumerate(fsdp_params):
        i = tg.param_items[p][0]
        if tg.extension[p]:
            outputs = extensions.gather_inputs(tg, p, fp)
            if isinstance(outputs, str):
                return outputs
            for i, t in zip(tg.param_items[p], outputs):
                if t.device.type == "cuda":  # fresh tensors of the copy-in stream, read on the AG stream
                    t.record_stream(all_gather_stream)
                inputs[i] = t
            continue
        its = tg.param_items[p]
        resident = tg.param_resident[p]
        if resident is not None and fp._sharded_param_data.data_ptr() != resident.data_ptr():
            adopt_shard(tg, p)  # e.g. after load_state_dict(assign=True)
        shard = fp._sharded_param_data if resident is None else resident
        if len(its) == 1:
            inputs[i] = shard
            continue
        # A Shard(k > 0) parameter: its shard's rows, one per item (tide/plan.py [Note: Shard(k) as rows]).
        for i, row in zip(its, shard.view(len(its), -1)):
            inputs[i] = row
    return inputs


@torch.no_grad()
def adopt_shard(tg: Any, p: int) -> None:
    """§3.1 in-place shard adoption: copy the padded shard into the resident region once and
    repoint the sharded parameter's data and its DTensor local view (zero-offset views)."""
    fp = tg.pg.fsdp_params[p]
    resident = tg.param_resident[p]
    resident.copy_(fp._sharded_param_data)
    fp._sharded_param_data = resident
    dim = fp.fsdp_placement.dim
    length = fp.sharded_param._local_tensor.size(dim)
    fp.sharded_param._local_tensor = resident.view(fp.padded_sharded_param_size).narrow(dim, 0, length)


@torch.no_grad()
def unadopt_shard(tg: Any, p: int) -> None:
    """Moves an adopted shard back into a private tensor (disable())."""
    fp = tg.pg.fsdp_params[p]
    resident = tg.param_resident[p] if tg.param_resident else None
    if resident is None or fp._sharded_param_data.data_ptr() != resident.data_ptr():
        return
    own = fp._sharded_param_data.clone()
    dim = fp.fsdp_placement.dim
    length = fp.sharded_param._local_tensor.size(dim)
    fp._sharded_param_data = own
    fp.sharded_param._local_tensor = own.view(fp.padded_sharded_param_size).narrow(dim, 0, length)


def release_landing(tg: Any) -> None:
    """tg's parameters leave their arena landing for FSDP2's own storage (tg is sharded: no live
    parameter points there). Fresh all-gather outputs are allocated at the next unshard (by
    ``own_landings`` or stock's copy-out) and FSDP2 frees them at reshard, as stock does; the
    adopted shards stay where they are."""
    for fp in tg.pg.fsdp_params:
        _patches.unpatch_param_free(fp)
        fp.all_gather_outputs = []
        fp._unsharded_inner_tensors = []  # an extension's may alias the landing
        if hasattr(fp, "_unsharded_param"):
            del fp._unsharded_param


def own_storage_stock_reason(tg: Any, post_forward: bool) -> str | None:
    """Why an all-gather of tg, which moved to its own storage, goes to stock FSDP2; None where
    TIDE-AG pulls into the own storage ([Note: own-storage landing])."""
    moved = f"moved to its own storage ({tg.moved})"
    if post_forward:
        return (f"{moved}; the post-forward re-gather pushes into the ranks' landings, which must "
                "be arena memory")
    for c in tg.chunks:
        if not comm.ExecutorTransport.pulls(c.plan, False):
            what = "extension outputs" if c.extension else f"{_name(c.shard_dtype)} shards"
            return (f"{moved}; its {what} are all-gathered without a cast, so TIDE-AG pushes "
                    "into the peers' landings, which must be arena memory (a cast, e.g. "
                    "MixedPrecisionPolicy(param_dtype=torch.bfloat16) over fp32 shards, pulls)")
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# [Note: own-storage landing]
# A group that moved to its own storage (placement.py [Note: ring depth]) lands in its
# parameters' FSDP2 ``all_gather_outputs``, not in arena memory. Where its all-gather pulls (every
# chunk casts; never the post-forward re-gather), each rank's landing is written by that rank
# alone, from the peers' stage slots (comm.py; [Note: pull landing] in tide/program.h), so
# TIDE-AG binds those outputs per call and lands in them: no copy-out. The lifetimes are stock
# FSDP2's: its own ``free_unsharded_param`` (restored by release_landing) frees the outputs'
# storage at reshard, and they are allocated back here at the next unshard, as stock's copy-out
# does it (``init_all_gather_outputs`` the first time, then a resize of the same storage, which
# the unsharded parameters and what autograd saved of them share). The allocation is on the
# copy-in stream, as stock's all-gather buffer; the AG stream (ordered after it) writes the
# storage and the compute stream reads and frees it, so both are recorded on it
# (``record_stream``): the caching allocator reuses it only after their work before the free.
# A Shard(k > 0) parameter's rows land as its items' views of its one output (tide/plan.py
# [Note: Shard(k) as rows]).
def own_landings(tg: Any, device: torch.device, users: tuple) -> list[torch.Tensor]:
    """Per AG item, its landing in tg's own storage: a view of its parameter's FSDP2
    ``all_gather_outputs[0]``, (re)allocated here on the copy-in stream. See
    [Note: own-storage landing]."""
    landings: list[Any] = [None] * len(tg.items)
    for p, fp in enumerate(tg.pg.fsdp_params):
        its = tg.param_items[p]
        c = tg.chunk_of(its[0])
        layout = c.plan.layout
        N = layout.N
        fp.init_all_gather_outputs([sum(tg.elements[i] for i in its)], [tg.item_dtypes[its[0]]],
                                   N, device)
        out = fp.all_gather_outputs[0]
        storage, nbytes = out.untyped_storage(), out.numel() * out.element_size()
        if storage.size() != nbytes:  # freed at the last reshard (FSDP2's free_storage)
            storage.resize_(nbytes)
        if out.device.type == "cuda":
            for stream in users:
                out.record_stream(stream)
        first = layout.landing(tg.local_index[its[0]], 0)
        for i in its:  # a Shard(k > 0) parameter's rows (tide/plan.py [Note: Shard(k) as rows])
            at = (layout.landing(tg.local_index[i], 0) - first) // out.element_size()
            landings[i] = out.narrow(0, at, N * tg.elements[i])
    return landings


@torch.no_grad()
def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
    """The module-level copy-out, where FSDP2 has no per-group seam (see _patches)."""
    if not isinstance(all_gather_result, TideAllGatherResult):
        return _patches.stock(_patches._pg, "foreach_all_gather_copy_out")(
            all_gather_result, fsdp_params, group)
    device = all_gather_result.all_gather_output.device
    handle = _get_device_handle(device.type)
    if all_gather_result.all_gather_event is not None:
        handle.current_stream().wait_event(all_gather_result.all_gather_event)
    work = all_gather_result.all_gather_work
    if work is not None:
        work.wait()
    # Nothing to copy: the shards landed in the unsharded parameters' storage.


def copy_out_for(previous: Any) -> Any:
    """A served group's ``_all_gather_output_fn`` where FSDP2 has that seam: FSDP2's
    ``foreach_all_gather_copy_out`` has already waited for the all-gather's event and work, and a
    TIDE result has nothing to copy; any other result (a call TIDE handed to stock) goes to the
    function the group had before."""
    def all_gather_output_fn(fsdp_params, all_gather_result, world_size):
        if isinstance(all_gather_result, TideAllGatherResult):
            return None
        return previous(fsdp_params, all_gather_result, world_size)
    return all_gather_output_fn


def init_outputs_at_world_1(tg: Any, p: int) -> Any:
    """Per-instance FSDPParam.init_all_gather_outputs for a single-rank job, where FSDP2 never
    calls foreach_all_gather and casts each shard straight into ``all_gather_outputs[0]`` (the
    landing view) on the compute stream: the ring slot is acquired here instead.
    See [Note: world 1] in groups.py."""
    def init_all_gather_outputs(all_gather_input_numels, all_gather_input_dtypes, world_size,
                                device, *rest, **named):
        # torch 2.11 has ``force_recreate`` (a sixth argument); 2.15 has none (_patches.py
        # checks both signatures): what FSDP2 passed goes on unchanged.
        force_recreate = bool(rest[0] if rest else named.get("force_recreate", False))
        rt, fp = tg.runtime, tg.pg.fsdp_params[p]
        if tg.moved is None and p == 0:
            rt.acquire_slot(tg, _get_device_handle(rt.device.type).current_stream(), copy_out=True)
        if tg.moved is not None:
            # In its own storage: FSDP2 allocates the outputs and casts the shard into them, as
            # it does into the landing views; nothing is gathered, so no peer needs arena memory.
            if p == 0:
                rt.stats["ag_tide"] += 1
                rt.stats["ag_own_storage"] += 1
            return type(fp).init_all_gather_outputs(fp, all_gather_input_numels,
                                                    all_gather_input_dtypes, world_size, device,
                                                    *rest, **named)
        if force_recreate or list(all_gather_input_numels) != [tg.elements[p]]:
            raise RuntimeError(f"tide_torch: group {tg.fqn} parameter {p}: FSDP2 asked for "
                               f"all-gather outputs {list(all_gather_input_numels)} "
                               f"(force_recreate={force_recreate}); TIDE planned "
                               f"[{tg.elements[p]}]")
        if p == 0:
            rt.stats["ag_tide"] += 1
    return init_all_gather_outputs


foreach_all_gather._tide_hook = True
foreach_all_gather_copy_out._tide_hook = True
