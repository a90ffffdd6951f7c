"""Shard(k > 0) parameters served by TIDE (tide/plan.py [Note: Shard(k) as rows]; reduce_scatter.py
[Note: Shard(k) gradients]): world 4 on CPU (2 nodes x 2, gloo ranks as processes), against
stock FSDP2 on identical per-rank data (exact gradient sums), parameters bitwise equal.

- TinyLlama whose first block shards its 2-D weights on dim 1 next to its dim-0 norm weights
  (mixed placements in one group), both modes;
- a torchtitan-style MoE: 3-D expert weights (experts, out, in) sharded on dim 1 (as torchtitan
  does when the FSDP degree exceeds the expert count), top-2 routing with a for-loop over the
  experts, a dim-0 router in the same group.

Every group served, every all-gather and reduce-scatter through TIDE, each rank's columns landing
at their strided place in the unsharded parameter (the parameter is a view of TIDE's landing).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import tide
from _torch_dist import assert_same, batches, build, mesh_1d, spawn, train

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
LAYOUT_OPS = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in")


def _served(handle, what):
    assert not handle.fallbacks, (what, handle.fallbacks)
    s = handle.stats
    assert s["ag_tide"] > 0 and s["rs_tide"] > 0, (what, s)
    assert s["ag_stock"] == 0 and s["rs_stock"] == 0, (what, s, handle.hand_backs)
    for name, (planned, got) in handle.landings().items():
        assert got == planned, (what, name)


def _shard1(p):
    from torch.distributed.tensor import Shard
    return Shard(1) if p.ndim >= 2 else None


def _llama(rank, world):
    import tide_torch
    mesh = mesh_1d()
    data = batches(3, same_on_all_ranks=True)
    stock = build(mesh=mesh, shard_placement_fn=_shard1)
    train(stock, data[:2])
    train(stock, data[2:])  # a fresh optimizer, as the profiled step has
    for mode in ("in_place", "slot_reuse"):
        model = build(mesh=mesh, shard_placement_fn=_shard1)
        handle = tide_torch.enable(model, mode=mode, topology=TOPO)
        g = next(g for g in handle.groups if g.fqn == "layers.0")
        assert sorted(set(g.shard_dims)) == [0, 1], g.shard_dims
        assert len(g.items) > len(g.shapes)  # a Shard(1) weight is one item per row
        train(model, data[:2])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train(model, data[2:])
        ops = sorted({e.name for e in prof.events() if any(b in e.name for b in LAYOUT_OPS)})
        assert not ops, (mode, ops)
        _served(handle, f"Shard(1) llama {mode}")
        assert_same(model, stock, f"Shard(1) llama {mode}")
        handle.disable()


class MoE(nn.Module):
    """torchtitan's MoE shape: a router and GroupedExperts-like 3-D weights (experts first)."""

    def __init__(self, dim=16, hidden=32, experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.top_k = top_k

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        scores, index = torch.topk(F.softmax(self.router(x).float(), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            rows, slot = (index == e).nonzero(as_tuple=True)
            h = x[rows]
            y = (F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())) @ self.w2[e].t()
            out = out.index_add(0, rows, y * scores[rows, slot, None].to(y.dtype))
        return out.reshape(b, t, d)


class MoEModel(nn.Module):
    def __init__(self, vocab=37, dim=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoE(dim) for _ in range(layers))
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(h)


def _moe_model(mesh, device=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    torch.manual_seed(0)
    model = MoEModel()
    if device is not None:
        model = model.to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp,
                    shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else None)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _moe_train(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    device = next(model.parameters()).device
    for tokens in data:
        tokens = tokens.to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _moe(rank, world):
    import tide_torch
    mesh = mesh_1d()
    data = batches(3, same_on_all_ranks=True)
    stock = _moe_model(mesh)
    want = _moe_train(stock, data)
    model = _moe_model(mesh)
    handle = tide_torch.enable(model, topology=TOPO)
    g = next(g for g in handle.groups if g.fqn == "layers.0")
    assert g.shard_dims == [0, 1, 1, 1], g.shard_dims
    assert len(g.items) == 1 + 3 * 4, len(g.items)  # router, then experts' rows
    assert _moe_train(model, data) == want
    _served(handle, "MoE Shard(1)")
    assert_same(model, stock, "MoE Shard(1)")
    handle.disable()


def test_shard1_llama():
    spawn(_llama)


def test_shard1_moe():
    spawn(_moe)
