"""Hugging Face transformers models under FSDP2 + TIDE stay bitwise equal to stock, with no
fallback: Llama, Qwen2 (q/k/v biases, tied embeddings) and Qwen3-MoE, its experts both
as transformers 5's fused 3-D parameters and as one ``nn.Linear`` MLP per expert (transformers
4's layout, where experts that get no token have no gradient: TIDE-RS in parts).

Each model is built from a tiny config (random init, same seed on every rank), sharded as a user
does (``fully_shard`` on every decoder layer, then the root; bf16 parameters, fp32 reduce), and
trained for three AdamW steps on the same tokens on every rank (exact gradient sums) by stock
FSDP2 and by TIDE in In-Place and Slot-Reuse, world 4 over gloo as 2 nodes x 2. TIDE did the
work: every group served (``handle.fallbacks`` empty), every all-gather and reduce-scatter through
TIDE (``handle.stats``), no FSDP2 layout op in the profiled third step, parameters bitwise equal.

Qwen3-MoE's 3-D experts run transformers' default experts implementation (``grouped_mm``), one
expert per rank after dim-0 sharding. The per-expert variant has 16 experts (57 parameters a
layer group): some get no token, so their layer's reduce-scatters run in parts (sub-plans). A
second per-expert variant has 86 experts (267 parameters a layer group, as a Qwen3-30B-A3B layer
in that layout has 393): past one plan's 256 parameters, each layer group is planned in two
chunks (tide_torch/groups.py [Note: chunks]) and still served whole.

One spawn runs every model: each rank imports transformers once (seconds on a small machine).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

try:
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"transformers is not importable ({e}); it is pinned in requirements/"
                "frameworks.txt and requirements/torch-newest.txt", allow_module_level=True)

import tide
from _torch_dist import assert_same, spawn

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
LAYOUT_OPS = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in")
VOCAB = 67  # dim 0 not divisible by the world size
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
PER_EXPERT = 16  # experts of the per-expert-Linear variant: 3 * 16 + 9 = 57 parameters a layer
WIDE = 86        # ... and of the wide one: 3 * 86 + 9 = 267 parameters a layer (> 256: two chunks)


class PerExpertMLPs(nn.ModuleList):
    """Qwen3-MoE's experts as one ``Qwen3MoeMLP`` (gate/up/down ``nn.Linear``) per expert, the
    layout of transformers 4 (``mlp.experts.<i>.gate_proj.weight``; transformers 5 fuses them into
    3-D parameters). A drop-in for ``Qwen3MoeExperts``: the same forward as its eager one, with
    expert ``i``'s MLP in place of its slices of ``gate_up_proj`` / ``down_proj``."""

    def __init__(self, config):
        super().__init__(Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size)
                         for _ in range(config.num_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=len(self)).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            pos, tok = torch.where(mask[e[0]])
            out = self[int(e[0])](hidden_states[tok]) * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, out.to(final.dtype))
        return final


def _config(name: str):
    if name == "llama":
        return LlamaConfig(**COMMON)
    if name == "qwen2":  # q/k/v biases; tied embeddings (as Qwen2-0.5B)
        return Qwen2Config(**COMMON, tie_word_embeddings=True)
    experts = {"qwen3_moe_3d": 4, "qwen3_moe_linear": PER_EXPERT, "qwen3_moe_wide": WIDE}[name]
    return Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=experts, num_experts_per_tok=2,
                          moe_intermediate_size=16, norm_topk_prob=True)


def _build(name: str, mesh) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    config = _config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if name in ("qwen3_moe_linear", "qwen3_moe_wide"):
        for layer in model.model.layers:
            layer.mlp.experts = PerExpertMLPs(config)
        for m in model.model.layers.modules():  # PreTrainedModel's nn.Linear init
            if isinstance(m, Qwen3MoeMLP):
                for p in m.parameters():
                    nn.init.normal_(p, mean=0.0, std=config.initializer_range)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _train(model: nn.Module, data: list) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for tokens in data:
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()


def _served_everywhere(handle, what) -> None:
    assert not handle.fallbacks, (what, handle.fallbacks)
    s = handle.stats
    assert s["ag_tide"] > 0 and s["rs_tide"] > 0, (what, s)
    assert s["rs_stock"] == 0 and s["ag_stock"] == 0, (what, s, handle.hand_backs)


def _no_layout_ops(model, data, what) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(model, data)
    ops = sorted({e.name for e in prof.events() if any(b in e.name for b in LAYOUT_OPS)})
    assert not ops, (what, ops)


MODELS = ("llama", "qwen2", "qwen3_moe_3d", "qwen3_moe_linear", "qwen3_moe_wide")


def _hf_models(rank, world):
    import tide_torch
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)  # the same tokens on every rank
    data = [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(3)]
    for name in MODELS:
        stock = _build(name, mesh)
        _train(stock, data[:2])
        _train(stock, data[2:])  # a fresh optimizer, as the profiled step has
        for mode in ("in_place", "slot_reuse"):
            what = f"{name} {mode}"
            model = _build(name, mesh)
            handle = tide_torch.enable(model, mode=mode, topology=TOPO)
            _train(model, data[:2])
            _no_layout_ops(model, data[2:], what)
            _served_everywhere(handle, what)
            assert_same(model, stock, what)
            if name != "qwen3_moe_3d" and name.startswith("qwen3_moe"):
                # experts without tokens: reduce-scatters in parts
                parts = {gr.fqn: len(gr.sub_plans) for gr in handle.groups}
                assert any(parts.values()), (what, parts)
            if name == "qwen3_moe_wide":  # > 256 parameters a layer: two plans each
                assert "model.layers.0[0:256]" in handle.plans, sorted(handle.plans)
                assert "model.layers.1[256:267]" in handle.plans, sorted(handle.plans)
            handle.disable()


def test_hf_models():
    spawn(_hf_models)
