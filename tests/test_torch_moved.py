"""Groups that stop fitting the ring move to storage of their own and keep TIDE-AG where it pulls
(placement.py [Note: ring depth], all_gather.py [Note: own-storage landing]); world 4 on CPU,
gloo ranks as processes, each step profiled and compared bitwise with stock FSDP2 after it:

- a manual ``unshard()`` of every block before each forward (2 nodes x 2), and forward
  prefetching two modules ahead set after ``enable()`` (1 node x 4), under a bf16
  MixedPrecisionPolicy (fp32 shards, a cast: the all-gather pulls): every all-gather FSDP2 issues
  runs through TIDE (``ag_tide`` equals the step's ``FSDP::all_gather`` ranges, no hand-back),
  the moved groups' into their own storage (``ag_own_storage``), and no FSDP2 layout op runs;
- the same ``unshard()`` in fp32 (no cast: TIDE-AG pushes into arena landings): the moved group's
  all-gathers are handed to stock FSDP2, counted, logged once with that reason;
- a group's slot held between its forward and its backward raises, naming both groups and the
  remedies.
"""
from __future__ import annotations

import logging

import torch

import tide
from _torch_dist import batches, build, mesh_1d, spawn, train
from tide_apps.llama import local_shards, reshard

LAYOUT_OPS = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _steps(model, data, before, handle=None):
    """One profiled optimizer step per batch, ``before(model)`` first. Per step: this rank's
    shards after it, the all-gathers FSDP2 issued, the FSDP2 layout ops that ran and (TIDE) the
    step's ``handle.stats`` increments."""
    out = []
    for tokens in data:
        first = dict(handle.stats) if handle is not None else {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            before(model)
            train(model, [tokens])
        names = [e.name for e in prof.events()]
        ags = sum(1 for n in names if n.startswith("FSDP::all_gather") and "copy_out" not in n)
        ops = sorted({n for n in names if any(op in n for op in LAYOUT_OPS)})
        delta = {k: v - first.get(k, 0) for k, v in handle.stats.items()} if handle else {}
        reshard(model)
        out.append((local_shards(model), ags, ops, delta))
    return out


def _unshard_all(model):
    for b in model.layers:
        b.unshard()


def _prefetch_two(model):
    blocks = list(model.layers)
    for i, b in enumerate(blocks):
        b.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
    return model


def _against_stock(make, before, topo, what, *, after_enable=None, mode="in_place"):
    """Stock and TIDE models from ``make()``, stepped alike; bitwise equal after every step.
    Returns TIDE's handle (still enabled), its per-step records, the log lines and the model."""
    import tide_torch
    stock = _steps(after_enable(make()) if after_enable else make(), DATA, before)
    model = make()
    lines = _Lines()
    logging.getLogger("tide_torch").addHandler(lines)
    try:
        handle = tide_torch.enable(model, topology=topo, mode=mode)
        if after_enable is not None:
            after_enable(model)
        got = _steps(model, DATA, before, handle)
    finally:
        logging.getLogger("tide_torch").removeHandler(lines)
    for step, ((ref, ref_ags, _, _), (shards, ags, _, _)) in enumerate(zip(stock, got)):
        for name, t in ref.items():
            assert torch.equal(shards[name], t), (what, step, name, (shards[name] - t).abs().max())
        assert ags == ref_ags, (what, step, ags, ref_ags)
    return handle, got, lines.lines, model


def _served_in_own_storage(handle, got, lines, model, what, moved):
    assert not handle.fallbacks, (what, handle.fallbacks)
    assert {g.fqn for g in handle.groups if g.moved} == moved, (what, {g.fqn: g.moved for g in handle.groups})
    for step, (_, ags, ops, delta) in enumerate(got):
        # every all-gather FSDP2 issued ran through TIDE, none was handed back ...
        assert ags > 0 and delta["ag_tide"] == ags, (what, step, ags, delta)
        assert delta["ag_stock"] == 0 and delta["rs_stock"] == 0, (what, step, delta)
        assert delta["ag_pull_chunks"] >= delta["ag_tide"], (what, step, delta)
        # ... the moved groups' into their own storage, with no FSDP2 layout op in the step.
        assert delta["ag_own_storage"] > 0, (what, step, delta)
        assert not ops, (what, step, ops)
    assert not handle.hand_backs, (what, handle.hand_backs)
    for fqn in moved:  # one line per move, saying where its all-gathers go
        said = [x for x in lines if f"group {fqn} moved to its own storage" in x]
        assert len(said) == 1 and "through TIDE-AG" in said[0], (what, fqn, lines)
    assert not any("hands all-gathers to stock" in x for x in lines), (what, lines)
    # handle.landings() names where a moved group's parameters live while unsharded: FSDP2's
    # own all-gather outputs (the planned ring address is no longer theirs).
    _unshard_all(model)
    landings = handle.landings()
    for g in handle.groups:
        if g.fqn in moved:
            for p, fp in enumerate(g.pg.fsdp_params):
                name = fp._param_fqn or f"{g.fqn}[{p}]"  # handle.landings()' names
                planned, at = landings[name]
                assert planned == at == fp.all_gather_outputs[0].data_ptr() != 0, (what, name)
    reshard(model)


DATA: list = []


def _moved(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mesh = mesh_1d()
    DATA[:] = batches(3, same_on_all_ranks=True)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    two_nodes, one_node = tide.Topology(nodes=2, gpus_per_node=2), tide.Topology(nodes=1, gpus_per_node=4)

    # A manual unshard() of every block before the forward: layers.2 finds ring0 held by the
    # live layers.0 and moves before its first landing (Slot-Reuse: its gradients then stay in
    # autograd's storage).
    for mode in ("in_place", "slot_reuse"):
        what = f"unshard all, bf16, {mode}"
        handle, got, lines, model = _against_stock(lambda: build(mesh=mesh, mp_policy=bf16), _unshard_all,
                                                   two_nodes, what, mode=mode)
        _served_in_own_storage(handle, got, lines, model, what, {"layers.2"})
        handle.disable()

    # Forward prefetching two ahead, set after enable(): the ring's 2 slots no longer fit, so
    # every ring group moves at its first landing.
    what = "prefetch 2 after enable(), bf16"
    handle, got, lines, model = _against_stock(lambda: build(mesh=mesh, n_layers=4, mp_policy=bf16),
                                               lambda m: None, one_node, what, after_enable=_prefetch_two)
    _served_in_own_storage(handle, got, lines, model, what, {f"layers.{i}" for i in range(4)})
    handle.disable()

    # fp32, no cast: the moved group's all-gathers push, so they go to stock FSDP2 (counted,
    # one log line with the reason); everything else stays TIDE's.
    what = "unshard all, fp32"
    handle, got, lines, _ = _against_stock(lambda: build(mesh=mesh, mp_policy=MixedPrecisionPolicy()),
                                           _unshard_all, two_nodes, what)
    assert {g.fqn for g in handle.groups if g.moved} == {"layers.2"}, what
    backs = handle.hand_backs
    assert {(fqn, c) for fqn, c, _ in backs} == {("layers.2", "ag")}, backs
    (reason,) = {r for _, _, r in backs}
    assert "own storage" in reason and "without a cast" in reason and "arena memory" in reason, reason
    assert sum(d["ag_stock"] for *_, d in got) == sum(backs.values()) > 0, (got, backs)
    assert all(d["ag_tide"] > 0 and d["rs_stock"] == 0 and d["ag_own_storage"] == 0
               for *_, d in got), got
    said = [x for x in lines if "hands all-gathers to stock" in x]
    assert len(said) == 1 and "layers.2" in said[0] and reason in said[0], lines
    handle.disable()

    # Unresolvable: layers.0 unsharded (manually) between layers.2's forward and its backward,
    # in the ring slot where autograd saved layers.2's parameters.
    import tide_torch
    model = build(mesh=mesh, mp_policy=bf16)
    handle = tide_torch.enable(model, topology=two_nodes)
    tokens = DATA[0]
    logits = model(tokens[:, :-1])
    model.layers[0].unshard()
    try:
        logits.float().sum().backward()
    except RuntimeError as e:
        msg = str(e)
        for part in ("layers.2", "layers.0", "ring slot ring0", "ring=False", "before enable()"):
            assert part in msg, (part, msg)
    else:
        raise AssertionError("a slot held between a group's forward and backward did not raise")


def test_moved_groups_keep_tide_all_gathers():
    spawn(_moved)


def _moved_at_world_1(rank, world):
    # One rank: FSDP2 casts each shard into its all-gather outputs (groups.py [Note: world 1]);
    # the moved group's outputs are FSDP2's own, every all-gather still counted as TIDE's.
    import tide_torch
    mesh = mesh_1d()
    DATA[:] = batches(2, same_on_all_ranks=True)
    stock = _steps(build(mesh=mesh), DATA, _unshard_all)
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, serve_single_rank=True)
    got = _steps(model, DATA, _unshard_all, handle)
    assert {g.fqn for g in handle.groups if g.moved} == {"layers.2"}
    for step, ((ref, *_), (shards, _, _, delta)) in enumerate(zip(stock, got)):
        for name, t in ref.items():
            assert torch.equal(shards[name], t), (step, name)
        assert delta["ag_own_storage"] > 0 and delta["ag_stock"] == 0, delta
    assert not handle.hand_backs, handle.hand_backs
    handle.disable()


def test_moved_group_at_world_1():
    spawn(_moved_at_world_1, world=1)
