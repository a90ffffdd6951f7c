"""The Llama-style model in torch and its FSDP2 training loop, written once: `tide demo`
(tide_apps/demo_train.py), examples/fsdp2_llama.py (which `tide bench train` runs) and the
tide_torch tests (tests/_torch_dist.py) all build and train this one.

The model: token embedding (vocab, dim); per block RMSNorm, grouped-query attention (wq, wk, wv,
wo; causal, no positional encoding), RMSNorm and a SwiGLU MLP (w2(silu(w1 x) * w3 x)); a final
RMSNorm and an untied output head. Parameter names, shapes and order are
tide_apps/llama_spec.param_specs' (the JAX twin in examples/flax_fsdp.py has the same). RMSNorm,
chosen per caller:
  "explicit": hand-written: statistics and the weight's product in fp32, the result cast back to
              the input's dtype (bf16 under MixedPrecisionPolicy(bf16, fp32)), the numbers every
              caller's bitwise comparisons were taken with; its weight's gradient is bf16;
  "torch":    torch's nn.RMSNorm, as users write it: on torch 2.15 its weight's gradient is fp32
              while the Linear weights' are bf16 (FSDP2 keeps the dtype autograd produces).
Attention, chosen per caller and kept so (their results are compared bit for bit):
  "explicit": softmax(q k^T / sqrt(hd) + causal mask) in fp32, cast back (the demo, the tests:
              deterministic on CUDA too);
  "sdpa":     F.scaled_dot_product_attention(is_causal=True) (the example: the fast kernels).
The training loop: next-token cross entropy on fp32 logits, backward, optimizer step; gradient
accumulation, FSDP2's gradient-sync toggling, a loss scale, one profiled step (FSDP2's layout
copies counted by torch.profiler) and per-phase hooks, each off unless asked for.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ATTENTION = ("explicit", "sdpa")
NORMS = ("explicit", "torch")
# FSDP2's layout copies, as torch.profiler names them (the aten op inside each fsdp:: wrapper;
# all_gather_copy_in has no aten op of its own).
COPY_OPS = ("aten::split_with_sizes_copy", "aten::_chunk_cat", "fsdp::all_gather_copy_in")
_ELEM = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # 1-D

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def _norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind not in NORMS:
        raise ValueError(f"Llama: norm must be one of {NORMS}, got {kind!r}")
    return RMSNorm(dim, eps) if kind == "explicit" else nn.RMSNorm(dim, eps=eps)


class Block(nn.Module):
    """A Llama decoder block: RMSNorm, GQA attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int,
                 attention: str = "explicit", eps: float = 1e-6, norm: str = "explicit"):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"Llama: attention must be one of {ATTENTION}, got {attention!r}")
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.attention = attention
        self.attention_norm = _norm(norm, dim, eps)
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)
        self.ffn_norm = _norm(norm, dim, eps)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
            mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
            y = F.softmax(att.float() + mask, dim=-1).type_as(q) @ v
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        n = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int,
                 *, attention: str = "explicit", eps: float = 1e-6, norm: str = "explicit"):
        super().__init__()
        self.vocab = vocab
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden, attention, eps, norm)
                                    for _ in range(layers))
        self.norm = _norm(norm, dim, eps)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def fully_shard_llama(model: Llama, mesh=None, *, mp_policy=None, reshard_after_forward=True,
                      last_no_reshard: bool = False, shard_placement_fn=None) -> Llama:
    """FSDP2 on every block, then the root; MixedPrecisionPolicy(bf16, fp32) unless given.
    ``last_no_reshard``: the last block keeps its parameters unsharded after forward;
    ``shard_placement_fn``: for the first block only."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    n = len(model.layers)
    for i, layer in enumerate(model.layers):
        raf = False if last_no_reshard and i == n - 1 else reshard_after_forward
        fully_shard(layer, mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy,
                    shard_placement_fn=shard_placement_fn if i == 0 else None)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def layout_copies(prof, world: int) -> dict[str, dict[str, int]]:
    """Calls of FSDP2's layout copies in a profile, and the bytes each wrote."""
    out = {op: {"calls": 0, "bytes": 0} for op in COPY_OPS}
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name not in out:
            continue
        shapes, dtypes = e.shapes(), e.dtypes()
        if name == "aten::split_with_sizes_copy":   # all-gather output -> unsharded params
            i, frac = 0, 1
        elif name == "aten::_chunk_cat":            # gradients -> packed fp32 RS input (out=)
            i, frac = 3, 1
        else:                                       # this rank's shards -> its AG input slot
            i, frac = 1, world
        out[name]["calls"] += 1
        out[name]["bytes"] += math.prod(shapes[i]) * _ELEM.get(dtypes[i], 0) // frac
    return out


@dataclass
class Trained:
    """What train() measured: one loss per micro-batch, one wall time per optimizer step (s);
    for the profiled step FSDP2's layout copies and the change of ``counters()`` over it."""
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    copies: dict | None = None
    counters: dict | None = None


def train(model: nn.Module, data: list, opt, *, accumulate: int = 1, set_sync: bool = False,
          loss_scale: float = 1.0, device=None, profile_step: int | None = None,
          counters: Callable[[], dict] | None = None, phase: Callable[[str], None] | None = None,
          mean_over_ranks: bool = False, trace_step: int | None = None,
          on_trace: Callable | None = None) -> Trained:
    """Trains on ``data`` (token batches (B, seq + 1): inputs [:, :-1], targets [:, 1:]), one
    optimizer step per ``accumulate`` batches. ``set_sync``: FSDP2 syncs gradients on the last
    micro-batch only; ``device``: batches move there (CUDA: each step ends with a synchronize);
    ``profile_step``: that step runs under torch.profiler; ``phase(name)``: called after
    "forward", "backward" and "optimizer"; ``mean_over_ranks``: each loss is the mean over the
    ranks (all-reduced after the step's clock stops); ``trace_step``: that step runs under
    torch.profiler with CPU and CUDA activities inside a ``bench::step`` annotation, and
    ``on_trace(prof)`` gets the profile (tide_apps/bench/timeline.py reads its trace)."""
    vocab = model.vocab
    cuda = device is not None and torch.device(device).type == "cuda"
    mark = phase or (lambda name: None)
    out = Trained()
    for step in range(len(data) // accumulate):
        profiling, tracing = step == profile_step, step == trace_step and not step == profile_step
        before = counters() if profiling and counters is not None else None
        acts = [torch.profiler.ProfilerActivity.CPU]
        if tracing and cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with (torch.profiler.profile(activities=acts, record_shapes=profiling) if profiling or tracing
              else contextlib.nullcontext()) as prof, \
                (torch.profiler.record_function("bench::step") if tracing else contextlib.nullcontext()):
            t0 = time.perf_counter()
            step_losses = []
            for micro in range(accumulate):
                tokens = data[step * accumulate + micro]
                if device is not None:
                    tokens = tokens.to(device)
                if set_sync:
                    model.set_requires_gradient_sync(micro == accumulate - 1)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, vocab),
                                       tokens[:, 1:].reshape(-1))
                del logits
                mark("forward")
                (loss * loss_scale if loss_scale != 1.0 else loss).backward()
                mark("backward")
                step_losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            mark("optimizer")
            if cuda:
                torch.cuda.synchronize(device)
            out.times.append(time.perf_counter() - t0)
        if tracing and on_trace is not None:
            on_trace(prof)
        if profiling:
            out.copies = layout_copies(prof, dist.get_world_size())
            if before is not None:
                out.counters = {k: v - before[k] for k, v in counters().items()}
        for loss in step_losses:
            if mean_over_ranks:  # this rank's tokens' mean -> every rank's (equal counts)
                mean = loss.clone()
                dist.all_reduce(mean)
                out.losses.append(mean.item() / dist.get_world_size())
            else:
                out.losses.append(loss.item())
    return out


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameter shards, on CPU."""
    return {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}


def reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def compare_shards(ref: dict, got: dict) -> tuple[bool, float]:
    """(bitwise equal, max |difference|) of two runs' local parameter shards, by name."""
    if set(ref) != set(got):
        raise ValueError(f"parameter names differ: {sorted(set(ref) ^ set(got))}")
    same = all(torch.equal(got[n], t) for n, t in ref.items())
    diff = max((got[n].double() - t.double()).abs().max().item() for n, t in ref.items())
    return same, diff
