"""tide_torch serves the FSDP2 configurations real jobs use (world 4 on CPU, gloo ranks as
processes, 2 nodes x 2), each against stock FSDP2 on identical data, and TIDE did the work:
every group served, every all-gather and reduce-scatter through TIDE (``handle.stats``), no
FSDP2 layout op in a profiled step, parameters bitwise equal to stock (exact gradient sums).

- torch's own ``nn.RMSNorm``: on torch 2.15 its weight gets fp32 gradients while the Linear
  weights get bf16 ones (FSDP2 keeps what autograd produces): TIDE-RS in parts, each part in its
  own dtype (reduce_scatter.py [Note: RS parts]);
- a frozen parameter inside a group (a reduce-scatter with a subset of the gradients);
- explicit prefetching two modules ahead (the ring grows, placement.py [Note: ring depth]);
- a manual ``unshard()`` of every block before the forward: the group that finds its slot taken
  moves to its own storage (one log line), where its all-gathers still land through TIDE (they
  pull: all_gather.py [Note: own-storage landing]), no error, nothing handed back;
- ``reduce_dtype=torch.bfloat16``: one rounding of TIDE-RS's fp32 sum, no further from the fp32
  reference than stock's bf16 reduce-scatter ([Note: low-precision reduce]); ``torch.float16``:
  FSDP2's pre-division folded into alpha, within one fp16 ulp, closer than stock's fp16 ring
  (torch 2.15 hands TIDE fp16 gradients, which TIDE-RS reads in fp16);
- ``param_dtype=torch.float16``: the all-gather casts fp32 shards to fp16 as torch does;
- bf16 weights with fp32 norms in one group, with a bf16 policy and with none: one plan per
  dtype class, each parameter in its own dtype on the wire (groups.py [Note: chunks]);
- tensor parallelism: a 2-D (dp x tp) mesh with Colwise/Rowwise MLPs, DTensor parameters on a
  dp x tp mesh with TP 1 (torchtitan's SPMD layout), and HSDP x TP on a 3-D mesh (replicate x
  shard x tp) (groups.py [Note: DTensor parameters]);
- ``reshard_after_forward=2``: backward's re-gathers over the post-forward groups land in place
  (groups.py [Note: post-forward mesh]).
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

import tide
import _torch_dist as td
from _torch_dist import assert_same, batches, build, mesh_1d, spawn, train

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
LAYOUT_OPS = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in")


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def _served_everywhere(handle, what, *, ag_stock=0):
    assert not handle.fallbacks, (what, handle.fallbacks)
    s = handle.stats
    assert s["ag_tide"] > 0 and s["rs_tide"] > 0, (what, s)
    assert s["rs_stock"] == 0 and s["ag_stock"] == ag_stock, (what, s, handle.hand_backs)


def _no_layout_ops(model, data, what):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(model, data)
    ops = sorted({e.name for e in prof.events() if any(b in e.name for b in LAYOUT_OPS)})
    assert not ops, (what, ops)


def _against_stock(make, run, what, **enable):
    """``make()`` twice: stock FSDP2 and TIDE, each run by ``run(model)``; parameters bitwise
    equal. Returns TIDE's handle (still enabled)."""
    import tide_torch
    stock = make()
    run(stock)
    model = make()
    handle = tide_torch.enable(model, topology=TOPO, **enable)
    run(model)
    assert_same(model, stock, what)
    return handle


def _configurations(rank, world):
    import tide_torch
    mesh = mesh_1d()
    data = batches(3, same_on_all_ranks=True)

    # torch's nn.RMSNorm (mixed gradient dtypes on torch 2.15), both modes, profiled.
    stock = build(mesh=mesh, norm="torch")
    train(stock, data[:2])
    train(stock, data[2:])  # a fresh optimizer, as the profiled step has
    for mode in ("in_place", "slot_reuse"):
        model = build(mesh=mesh, norm="torch")
        handle = tide_torch.enable(model, mode=mode, topology=TOPO)
        train(model, data[:2])
        _no_layout_ops(model, data[2:], f"nn.RMSNorm {mode}")
        _served_everywhere(handle, f"nn.RMSNorm {mode}")
        assert_same(model, stock, f"nn.RMSNorm {mode}")
        for name, (planned, got) in handle.landings().items():
            assert got == planned, (mode, name)
        # torch 2.15's FSDP2 keeps nn.RMSNorm's fp32 weight gradients: those ran as fp32 parts.
        fp32_parts = {g.fqn for g in handle.groups
                      if any(dtype == torch.float32 for _, dtype in g.sub_plans)}
        mixed = _torch_at_least(2, 15)
        assert fp32_parts == ({"layers.0", "layers.1", "layers.2", "<root>"} if mixed else set()), \
            fp32_parts
        handle.disable()

    # A frozen parameter inside a group: its reduce-scatters carry a subset of the gradients.
    def frozen():
        m = build(mesh=mesh)
        m.layers[1].w3.weight.requires_grad_(False)
        return m
    handle = _against_stock(frozen, lambda m: train(m, data), "frozen")
    _served_everywhere(handle, "frozen")
    group = next(g for g in handle.groups if g.fqn == "layers.1")
    assert group.sub_plans, "the frozen group's reduce-scatters ran on a sub-plan"
    handle.disable()

    # Explicit prefetching two modules ahead, forward and backward: a ring of three slots.
    def prefetching():
        m = build(mesh=mesh, n_layers=4)
        blocks = list(m.layers)
        for i, b in enumerate(blocks):
            b.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
            b.set_modules_to_backward_prefetch(blocks[max(0, i - 2):i][::-1])
        return m
    handle = _against_stock(prefetching, lambda m: train(m, data), "prefetch 2")
    _served_everywhere(handle, "prefetch 2")
    slots = {g["slot"] for g in handle.memory()["groups"].values()}
    assert {"ring0", "ring1", "ring2"} <= slots, slots
    handle.disable()

    # A manual unshard() of every block before the forward.
    def unsharding_train(m):
        for step in range(len(data)):
            for b in m.layers:
                b.unshard()
            train(m, data[step:step + 1])
    handle = _against_stock(lambda: build(mesh=mesh), unsharding_train, "unshard all")
    assert [g.fqn for g in handle.groups if g.moved] == ["layers.2"], handle.groups
    _served_everywhere(handle, "unshard all")
    assert handle.stats["ag_own_storage"] > 0, handle.stats
    handle.disable()

    # reshard_after_forward=2: backward re-gathers over the 2-rank post-forward groups, in place.
    for mode in ("in_place", "slot_reuse"):
        handle = _against_stock(lambda: build(mesh=mesh, reshard_after_forward=2),
                                lambda m: train(m, data), f"raf=2 {mode}", mode=mode)
        _served_everywhere(handle, f"raf=2 {mode}")
        # every block's backward all-gather (3 blocks x 3 steps) ran over its post-forward group
        assert handle.stats["ag_post_forward"] == 9, handle.stats
        for name, (planned, got) in handle.landings().items():
            assert got == planned, (mode, name)
        handle.disable()


def test_configurations():
    spawn(_configurations)


def _grads(model, tokens):
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, td.VOCAB),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}


def check_one_rounding(got, stock, ref):
    """TIDE-RS with a bf16 reduce dtype ([Note: low-precision reduce]) against the fp32-reduce
    reference: per element within half a bf16 ulp, and no further than stock's bf16 result."""
    for name, r in ref.items():
        err, stock_err = (got[name].cpu() - r.cpu()).abs(), (stock[name].cpu() - r.cpu()).abs()
        r = r.cpu()
        # One rounding of the fp32 sum: within half a bf16 ulp of the reference (the fp32 sums
        # themselves may differ in their last bit: 2^-20 relative slack) ...
        half_ulp = r.abs() * 2.0 ** -8 + 2.0 ** -133
        assert (err <= half_ulp + r.abs() * 2.0 ** -20).all(), ("half ulp", name, (err - half_ulp).max())
        # ... and never further from it than stock's bf16 reduce-scatter.
        assert (err <= stock_err + r.abs() * 2.0 ** -20).all(), ("stock", name, (err - stock_err).max())
        assert got[name].dtype == torch.float32


def check_fp16_reduce(got, stock, ref):
    """An fp16 reduce dtype: FSDP2 pre-divides (overflow risk) and post-divides in fp16; TIDE-RS
    folds the pre-division into its fp32 sum and rounds once, then FSDP2 post-divides. Per element
    within one fp16 ulp of the fp32 reference (subnormals: 2^-24), and closer than stock's fp16
    ring on the whole (stock rounds every gradient to fp16 and again after each step)."""
    total, stock_total = 0.0, 0.0
    for name, r in ref.items():
        r = r.cpu()
        err, stock_err = (got[name].cpu() - r).abs(), (stock[name].cpu() - r).abs()
        ulp = r.abs() * 2.0 ** -10 + 2.0 ** -24
        assert (err <= ulp).all(), ("fp16 ulp", name, (err - ulp).max())
        total, stock_total = total + float(err.sum()), stock_total + float(stock_err.sum())
    assert total <= stock_total, (total, stock_total)


def _bf16_reduce(rank, world):
    import tide_torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mesh = mesh_1d()
    tokens = batches(1, same_on_all_ranks=False)[0]  # per-rank data: inexact bf16 sums
    # The hand-written RMSNorm: every gradient is bf16 under both reduce dtypes, so the fp32-reduce
    # run is the fp32 sum of the very gradients the bf16 runs reduce (with nn.RMSNorm, torch 2.15
    # gives its weight an fp32 gradient under an fp32 reduce dtype and a bf16 one under bf16).
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    ref = _grads(build(mesh=mesh), tokens)  # fp32 reduce: the reference
    stock = _grads(build(mesh=mesh, mp_policy=bf16), tokens)
    model = build(mesh=mesh, mp_policy=bf16)
    handle = tide_torch.enable(model, topology=TOPO)
    got = _grads(model, tokens)
    _served_everywhere(handle, "bf16 reduce")
    check_one_rounding(got, stock, ref)
    handle.disable()
    # An fp16 reduce dtype, from bf16 and from fp16 parameters (param_dtype=torch.float16 alone:
    # FSDP2 reduces in the parameter dtype). torch 2.15 hands autograd's gradients over in the
    # reduce dtype: TIDE-RS reads them in fp16. Against the fp32-reduce run of the same
    # all-gather dtype.
    for ag in (torch.bfloat16, torch.float16):
        what = f"{ag} all-gather, fp16 reduce"
        fp16 = MixedPrecisionPolicy(param_dtype=ag, reduce_dtype=torch.float16)
        if ag == torch.float16:
            ref = _grads(build(mesh=mesh, mp_policy=MixedPrecisionPolicy(
                param_dtype=ag, reduce_dtype=torch.float32)), tokens)
        stock = _grads(build(mesh=mesh, mp_policy=fp16), tokens)
        model = build(mesh=mesh, mp_policy=fp16)
        handle = tide_torch.enable(model, topology=TOPO)
        got = _grads(model, tokens)
        _served_everywhere(handle, what)
        check_fp16_reduce(got, stock, ref)
        handle.disable()
    # The same step with exact sums is bitwise equal to stock.
    data = batches(2, same_on_all_ranks=True)
    stock = build(mesh=mesh, mp_policy=bf16)
    train(stock, data)
    model = build(mesh=mesh, mp_policy=bf16)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data)
    _served_everywhere(handle, "bf16 reduce exact")
    assert_same(model, stock, "bf16 reduce exact")
    handle.disable()


def test_bf16_reduce_dtype():
    spawn(_bf16_reduce)


def _mixed_model(mesh, mp, *, frozen: bool = True):
    """The tiny Llama in bf16 with its RMSNorm weights in fp32 (HF's ``_keep_in_fp32_modules``
    for norms), frozen unless ``frozen=False``: every block's group and the root's hold both
    dtypes."""
    from tide_apps.llama import fully_shard_llama
    torch.manual_seed(0)
    model = td.TinyLlama(3).to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith("norm"):
            module.float().requires_grad_(not frozen)
    return fully_shard_llama(model, mesh, mp_policy=mp)


def _dtypes(rank, world):
    import tide_torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mesh = mesh_1d()
    data = batches(3, same_on_all_ranks=True)

    def check_classes(handle, what, classes):
        assert not handle.fallbacks, (what, handle.fallbacks)
        for g in handle.groups:  # each parameter in its own dtype on the wire
            assert {(c.ag_dtype, c.shard_dtype) for c in g.chunks} == classes, (what, g.fqn)
        assert any("[" in name for name in handle.plans), sorted(handle.plans)

    # fp16 all-gather: fp32 shards cast by TIDE-AG's CAST as torch's .to() rounds; the fp16
    # gradients reduce in fp32 (an fp16 reduce dtype: _bf16_reduce below).
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    handle = _against_stock(lambda: build(mesh=mesh, mp_policy=fp16), lambda m: train(m, data),
                            "param_dtype fp16")
    _served_everywhere(handle, "param_dtype fp16")
    assert all(c.ag_dtype == torch.float16 and c.casts for g in handle.groups for c in g.chunks)
    handle.disable()

    # bf16 weights with frozen fp32 norms in one group (FSDP2 takes one original dtype among
    # trainable parameters): one chunk per dtype class, the reduce-scatters on the weights.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for label, mp, classes in (
            ("bf16 policy", bf16, {(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)}),
            ("no policy", MixedPrecisionPolicy(), {(torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.float32)})):
        what = f"bf16 weights + frozen fp32 norms, {label}"
        handle = _against_stock(lambda: _mixed_model(mesh, mp), lambda m: train(m, data), what)
        _served_everywhere(handle, what)
        check_classes(handle, what, classes)
        handle.disable()

    # Trainable fp32 norms next to bf16 weights: stock FSDP2 refuses the group in the first
    # forward; TIDE (which plans it) changes nothing about that.
    stock = _mixed_model(mesh, bf16, frozen=False)
    try:
        train(stock, data)
    except AssertionError as e:
        assert "uniform original parameter dtype" in str(e), e
        model = _mixed_model(mesh, bf16, frozen=False)
        handle = tide_torch.enable(model, topology=TOPO)
        try:
            train(model, data)
        except AssertionError as e2:
            assert str(e2) == str(e), e2
        else:
            raise AssertionError("trained with TIDE where stock FSDP2 refused")
        handle.disable()
    else:
        raise AssertionError("stock FSDP2 trained trainable parameters of two dtypes: serve them")

    # torch 2.15's per-parameter policies: fp32 masters, weights gathered in bf16 (a cast), norms
    # kept in fp32 (adopted); their gradients bf16 and fp32.
    if "param_dtype_override_fn" in MixedPrecisionPolicy.__dataclass_fields__:
        per_param = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
            param_dtype_override_fn=lambda p: torch.float32 if p.ndim == 1 else None)
        what = "per-parameter policies"
        handle = _against_stock(lambda: build(mesh=mesh, mp_policy=per_param), lambda m: train(m, data),
                                what)
        _served_everywhere(handle, what)
        check_classes(handle, what, {(torch.bfloat16, torch.float32), (torch.float32, torch.float32)})
        handle.disable()


def test_dtypes():
    spawn(_dtypes)


def _tp_model(mesh2, *, colwise_rowwise: bool, device=None):
    """The tiny Llama on a dp x tp mesh: its MLPs Colwise/Rowwise over tp (or every Linear a
    DTensor on a tp mesh of 1, as torchtitan's SPMD layout has at TP 1), FSDP (or HSDP, where
    ``mesh2["dp"]`` is 2-D) over dp."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = td.TinyLlama(3, norm="torch")
    if device is not None:
        model = model.to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = ({"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
            if colwise_rowwise else
            {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(),
             "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
             "wo": RowwiseParallel()})
    for layer in model.layers:
        parallelize_module(layer, mesh2["tp"], plan)
        fully_shard(layer, mesh=mesh2["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh2["dp"], mp_policy=mp)
    return model


def _tensor_parallel(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    data = batches(3, same_on_all_ranks=True)
    for shape, colwise in (((2, 2), True), ((4, 1), False), ((2, 2, 1), False)):
        names = ("dp", "tp") if len(shape) == 2 else ("rep", "shard", "tp")
        mesh2 = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if len(shape) == 3:  # HSDP x TP: replicate over "rep", shard over "shard"
            mesh2 = {"dp": mesh2["rep", "shard"], "tp": mesh2["tp"]}
        what = f"dp x tp = {shape}"
        handle = _against_stock(lambda: _tp_model(mesh2, colwise_rowwise=colwise),
                                lambda m: train(m, data), what)
        _served_everywhere(handle, what)
        dtensor_groups = {g.fqn for g in handle.groups
                          if any(fp.is_dtensor for fp in g.pg.fsdp_params)}
        assert dtensor_groups >= {"layers.0", "layers.1", "layers.2"}, dtensor_groups
        handle.disable()


def test_tensor_parallel():
    logging.getLogger("tide_torch").setLevel(logging.ERROR)
    spawn(_tensor_parallel)


class _Experts(nn.Module):
    """A per-expert ``nn.Linear`` MoE layer as transformers 4.x writes it: more parameters than
    one plan holds (groups.py [Note: chunks]); ``active`` picks the experts that got tokens."""

    def __init__(self, n: int):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(td.DIM, td.DIM, bias=False) for _ in range(n))
        self.active: list[int] = list(range(n))

    def forward(self, h):
        return h + sum(self.experts[i](h) for i in self.active) / len(self.experts)


class _WideModel(nn.Module):
    def __init__(self, n_experts: int):
        super().__init__()
        self.vocab = td.VOCAB  # what the tests' train() reads
        self.tok_embeddings = nn.Embedding(td.VOCAB, td.DIM)
        self.moe = _Experts(n_experts)
        self.output = nn.Linear(td.DIM, td.VOCAB, bias=False)

    def forward(self, tokens):
        return self.output(self.moe(self.tok_embeddings(tokens)))


def _wide(rank, world):
    import tide_torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = mesh_1d()
    data = batches(2, same_on_all_ranks=True)

    def make():
        torch.manual_seed(0)
        m = _WideModel(300)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(m.moe, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
        return m

    def routed(m, data):  # every step a different set of experts gets no token
        losses = []
        for step in range(len(data)):
            m.moe.active = [i for i in range(300) if (i + step) % 3]
            losses += train(m, data[step:step + 1])
        return losses

    for run in (train, routed):
        stock = make()
        run(stock, data)
        for mode in ("in_place", "slot_reuse"):
            model = make()
            handle = tide_torch.enable(model, mode=mode, topology=TOPO)
            run(model, data)
            what = f"300 experts, {run.__name__}, {mode}"
            _served_everywhere(handle, what)
            assert_same(model, stock, what)
            assert sorted(handle.plans) == ["<root>", "moe[0:256]", "moe[256:300]"], sorted(handle.plans)
            for name, (planned, got) in handle.landings().items():
                assert got == planned, (what, name)
            moe = next(g for g in handle.groups if g.fqn == "moe")
            assert bool(moe.sub_plans) == (run is routed), (what, list(moe.sub_plans))
            handle.disable()


def test_groups_over_256_parameters_and_experts_without_tokens():
    spawn(_wide)
