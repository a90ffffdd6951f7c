"""Position-aware ring slots, ring-tail folding, and the arena byte layout (App. F).

Under FSDP2's default prefetch depth of 1 at most two resharding groups are unsharded at once, so
ring group g (in execution order) lands in slot g mod 2 and each slot is sized for the groups
assigned to it, not for the global maximum. The final group that does not reshard after forward
is live only across the forward/backward turn-around and alternates with its predecessor, so it
is folded into the ring (ring-tail folding). The root group (live for the whole step), other
non-resharding groups and groups that do not reshard after backward get ``fixed`` storage of
their own; ``enable(..., ring=False)`` gives every group fixed storage.

[Note: ring depth]
Explicit prefetching (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``) keeps more
groups unsharded at once: a module that prefetches d modules has d + 1 groups live. ``enable()``
reads the prefetch lists and gives the ring d + 1 slots (``ring0`` ... ``ring<d>``, group g in slot
g mod (d + 1), each sized for its largest group), one slot more per module of depth.

The runtime checks the assumption at every landing (``Runtime.acquire_slot``). A group moves to
storage of its own, with one log line, when it stops fitting the ring: it no longer reshards
after backward (``set_reshard_after_backward(False)`` after ``enable()``), the prefetch lists now
need more slots, or its slot is still held by a live group (a manual ``unshard()`` of many
modules). It gives up its slot; its storage is FSDP2's own ``all_gather_outputs``, allocated at
unshard and freed at reshard as stock does. Its all-gathers stay TIDE-AG where they pull (a
cast: fp32 shards gathered in bf16 or fp16), landing straight in that storage (all_gather.py
[Note: own-storage landing]); where TIDE-AG pushes into the peers' landings (no cast, extension
outputs, the post-forward re-gather), which must be arena memory, they go to stock FSDP2,
counted with that reason. Its reduce-scatters stay TIDE-RS (reading autograd's gradients).
It moves only before it lands and only while nothing refers to its landing: not unsharded, and
either no autograd or its forward of this iteration not yet run (FSDP2's ``post_forward_order``).
Between a group's forward and its backward, autograd has saved its unsharded tensors at the
slot's address; a conflict there (the slot held by another live group when the group's backward
re-gathers) cannot be resolved without corrupting, and raises, naming both groups and the
remedies (reshard the other group first, set the lists before ``enable()``, or
``enable(..., ring=False)``).
"""
from __future__ import annotations

import tide
from tide.regions import align_up
from tide_torch.arena import Arena
from tide.plan import RS_SCRATCH, region_bytes
from tide_torch.groups import TideGroup


def _reshards_after_forward(tg: TideGroup) -> bool:
    return tg.pg.post_forward_mesh_info is not None


def ring_depth(groups: list[TideGroup]) -> int:
    """Ring slots the model's prefetching needs (see [Note: ring depth])."""
    deepest = 1  # FSDP2's implicit prefetch: one module ahead
    for g in groups:
        for name in ("_states_to_forward_prefetch", "_states_to_backward_prefetch"):
            deepest = max(deepest, len(getattr(g.state, name, None) or ()))
    return deepest + 1


def assign(groups: list[TideGroup], use_ring: bool = True, rails: str = "one_sided") -> dict[str, int]:
    """Assigns slots and byte offsets to eligible groups; returns the arena region sizes.
    ``use_ring=False`` gives every group fixed storage (no slot sharing). ``rails``: the
    executor's (two-sided programs hold the lowering's counters too)."""
    served = [g for g in groups if g.eligible]
    # Groups that stay unsharded after backward (gradient accumulation without resharding) are
    # live across the step boundary: never in the ring.
    # Param groups of one module unshard together: they cannot alternate in the ring either.
    candidates = [g for g in served
                  if use_ring and not g.is_root and g.pg.reshard_after_backward
                  and g.siblings == 1]
    ring = [g for g in candidates if _reshards_after_forward(g)]
    tail = [g for g in candidates if not _reshards_after_forward(g)]
    # Ring-tail folding: the last non-resharding non-root group, if it is the last served group.
    if tail and served and tail[-1] is served[-1]:
        ring.append(tail.pop())
    depth = ring_depth(served)
    for k, g in enumerate(sorted(ring, key=lambda g: g.index)):
        g.ring_index, g.slot = k, f"ring{k % depth}"
    fixed = [g for g in served if g.slot == ""]
    for g in fixed:
        g.slot = "fixed"

    sizes = {f"ring{s}": 0 for s in range(depth)}
    sizes.update({"fixed": 0, "resident": 0, "stage": 0})
    # The planner's position-aware sizing: slot s holds the largest group g with g mod 2 = s
    # (with a deeper ring, g mod depth = s).
    ring_order = sorted((g for g in served if g.slot != "fixed"), key=lambda g: g.ring_index)
    if ring_order and depth == 2:
        slots = tide._core.ag_ring_slot_bytes([_landing_bytes(g) for g in ring_order])
        sizes["ring0"], sizes["ring1"] = int(slots[0]), int(slots[1])
    for g in ring_order if depth > 2 else ():
        sizes[g.slot] = max(sizes[g.slot], _landing_bytes(g))
    stage_slot = 0
    for g in served:
        base = 0
        if g.slot == "fixed":
            base = sizes["fixed"]
            sizes["fixed"] += _landing_bytes(g)
        for c in g.chunks:  # a group's chunks land one after the other (groups.py [Note: chunks])
            c.unsharded_offset = base
            base += align_up(c.plan.layout.S * c.plan.layout.N)
            if c.adopts:
                c.resident_offset = sizes["resident"]
                sizes["resident"] += align_up(c.plan.layout.S)
            elif c.casts:
                stage_slot = max(stage_slot, align_up(c.plan.layout.S))
    sizes["stage"] = max([2 * stage_slot] + [int(tide._core.plan_ag(pl).stage_bytes)
                                             for g in served for c in g.chunks
                                             for pl in (c.plan, c.plan_post_forward) if pl is not None])
    if served and all(g.world == 1 for g in served):
        sizes["stage"] = 0  # a single-rank job never all-gathers (groups.py [Note: world 1])
    # TIDE-RS scratch (staging/outbox/inbox/spare): reduce-scatters run one group at a time in
    # collective order, so one set sized for the largest group serves all of them.
    for name in RS_SCRATCH:
        sizes[name] = max((region_bytes(pl, name) for g in served
                           for pl in [g.rs_bound] + [q for c in g.rs_chunks for q in (c.plan, c.plan_fp32_grads)]
                           if pl is not None), default=0)
    # Counters: every group's ranges from one CounterSpace, in group order (the same on every
    # rank); the region also holds the executors' entry fence (tide/session.h).
    counters = tide._core.CounterSpace()
    for g in served:
        g.counter_bases = {}
        for c in g.chunks:  # the AG chunks (over items) ...
            g.counter_bases[c.key("ag")] = counters.reserve(c.plan, "all_gather", rails=rails)
            if c.plan_post_forward is not None:  # groups.py [Note: post-forward mesh]
                g.counter_bases[c.key("agpf")] = counters.reserve(c.plan_post_forward, "all_gather",
                                                                  rails=rails)
        for c in g.rs_chunks:  # ... and the RS chunks (over parameters; the same without extensions)
            g.counter_bases[c.key("rs")] = counters.reserve(c.plan, "reduce_scatter", rails=rails)
            if c.plan_fp32_grads is not None:
                g.counter_bases[c.key("rs32")] = counters.reserve(c.plan_fp32_grads, "reduce_scatter",
                                                                  rails=rails)
        # The group's sub-plan pool (reduce_scatter.py, [Note: RS parts]): a TIDE-RS program
        # set's counters depend on the topology and passes, not on the parameters, so ranges
        # sized by the group's plan hold any sub-plan's (checked when one is planned).
        bound = g.rs_bound or g.rs_chunks[0].plan  # groups.py [Note: chunks]
        one = tide._core.CounterSpace()
        one.reserve(bound, "reduce_scatter", rails=rails)
        g.counter_range = one.used
        g.counter_pool = [counters.reserve(bound, "reduce_scatter", rails=rails)
                          for _ in range(SUB_PLANS)]
        g.sub_plans = {}
    sizes["counters"] = counters.region_bytes
    return sizes


def _landing_bytes(g: TideGroup) -> int:
    return sum(align_up(c.plan.layout.S * c.plan.layout.N) for c in g.chunks)


SUB_PLANS = 16  # TIDE-RS sub-plans a group may plan (distinct gradient patterns; 8 B a counter)


def bind(groups: list[TideGroup], arena: Arena) -> None:
    """Turns region-relative offsets into arena offsets and builds each group's views."""
    stage = arena.region("stage")
    half = stage.nbytes // 2
    for g in groups:
        if not g.eligible:
            continue
        region = arena.region(g.slot)
        P = len(g.items)
        # Per AG item, in group order (a chunk's items need not be consecutive).
        g.landing_views, g.resident_views, g.input_views = [None] * P, [None] * P, [None] * P
        casting = 0  # the group's casting chunks so far
        for c in g.chunks:
            c.unsharded_offset += region.offset
            layout = c.plan.layout
            N = layout.N
            for i, (p, pl) in enumerate(zip(c.params, layout.params)):
                # Parameter-major: p's padded unsharded tensor starts at o_p*N (Eq. 2, r = 0).
                g.landing_views[p] = arena.view(c.unsharded_offset + layout.landing(i, 0), N * pl.e,
                                                g.item_dtypes[p])
            if c.extension:
                continue  # read where the pre-all-gather left them (extensions.py)
            if c.adopts:
                c.resident_offset += arena.region("resident").offset
                for p, pl in zip(c.params, layout.params):
                    g.resident_views[p] = g.input_views[p] = arena.view(
                        c.resident_offset + pl.o, pl.e, c.shard_dtype)
            elif stage.nbytes:  # (world 1 never all-gathers: no stage)
                # [Note: stage parity] consecutive casting all-gathers (groups, and a group's
                # casting chunks) use different stage slots, so the cast of the next never
                # writes the slot the current all-gather still reads.
                parity = ((g.ring_index if g.ring_index >= 0 else g.index) + casting) % 2
                casting += 1
                c.stage_offset = stage.offset + parity * half
                for p, pl in zip(c.params, layout.params):
                    g.input_views[p] = arena.flat(c.stage_offset + pl.o, pl.e, c.ag_dtype)
        _param_views(g, arena)


def _param_views(g: TideGroup, arena: Arena) -> None:
    """Per parameter, its landing (FSDPParam.all_gather_outputs[0]) and adopted resident shard:
    its one item's views, or one view over the consecutive rows of a Shard(k > 0) parameter
    (tide/plan.py [Note: Shard(k) as rows]). None for extension parameters (their outputs are
    the items' landing views)."""
    n = len(g.param_items)
    g.param_landing, g.param_resident = [None] * n, [None] * n
    for p, its in enumerate(g.param_items):
        if g.extension[p]:
            continue
        if len(its) == 1:
            g.param_landing[p], g.param_resident[p] = g.landing_views[its[0]], g.resident_views[its[0]]
            continue
        c, first = g.chunk_of(its[0]), g.local_index[its[0]]
        layout, total = c.plan.layout, sum(g.elements[i] for i in its)
        g.param_landing[p] = arena.view(c.unsharded_offset + layout.landing(first, 0),
                                        layout.N * total, c.ag_dtype)
        if c.adopts:
            g.param_resident[p] = arena.view(c.resident_offset + layout.params[first].o, total,
                                             c.shard_dtype)


def region_summary(groups: list[TideGroup], arena: Arena) -> dict:
    out = {"arena_bytes": arena.nbytes, "regions": arena.describe(), "groups": {}}
    stock_ag = 0
    for g in groups:
        if not g.eligible:
            continue
        ns = g.unsharded_bytes
        stock_ag += ns
        layouts = [c.plan.layout for c in g.chunks]
        out["groups"][g.fqn] = {
            "slot": g.slot, "unsharded_bytes": ns, "S": sum(x.S for x in layouts),
            "rs_output_bytes": sum(x.S_fp32 for x in layouts),
            "stock_rs_input_bytes": sum(x.B_pack for x in layouts), "chunks": len(layouts),
        }
        model = getattr(g.plan, "memory", None)  # one chunk: the plan's memory model
        if model is not None:
            m = model()
            out["groups"][g.fqn].update(
                {k: m[k] for k in ("live_tide_ns", "live_fsdp2_ns", "area_rs_ns") if k in m})
    out["stock_unsharded_bytes"] = stock_ag
    return out

