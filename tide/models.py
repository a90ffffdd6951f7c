"""Built-in parameter groups of the paper's three models, as FSDP2 wraps them.

Each model gives named groups of (parameter name, unsharded shape); FSDP2 shards every parameter
along dim 0. ``largest`` is the group with the most elements (the one TIDE's arena is sized for).
Config values are quoted from each model's published config (HF ``config.json`` / Wan2.2's
``wan/configs``); linear weights are (out_features, in_features) as nn.Linear stores them.
"""
from __future__ import annotations

from math import prod

from tide.plan import GroupSignature

Group = list[tuple[str, tuple[int, ...]]]


def _linear(name: str, out_f: int, in_f: int, bias: bool = False) -> Group:
    g = [(f"{name}.weight", (out_f, in_f))]
    if bias:
        g.append((f"{name}.bias", (out_f,)))
    return g


# --- Llama-3.1-70B (meta-llama/Llama-3.1-70B config.json) -------------------------------------
# hidden_size 8192, intermediate_size 28672, num_attention_heads 64, num_key_value_heads 8,
# head_dim 128 (= 8192/64), vocab_size 128256, tie_word_embeddings false, RMSNorm weights 1-D.
def _llama31_70b() -> dict[str, Group]:
    h, ffn, n_q, n_kv, hd, vocab = 8192, 28672, 64, 8, 128, 128256
    # Registration order of LlamaDecoderLayer: self_attn, mlp, input/post_attention_layernorm.
    block: Group = _linear("self_attn.q_proj", n_q * hd, h)
    block += _linear("self_attn.k_proj", n_kv * hd, h)
    block += _linear("self_attn.v_proj", n_kv * hd, h)
    block += _linear("self_attn.o_proj", h, n_q * hd)
    block += _linear("mlp.gate_proj", ffn, h)
    block += _linear("mlp.up_proj", ffn, h)
    block += _linear("mlp.down_proj", h, ffn)
    block += [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    return {
        "block": block,
        # The vocabulary layers: the embedding alone, and the output head wrapped with the final
        # norm (TorchTitan's last FSDP group); the head group is the larger by the norm's 8192.
        "embedding": [("embed_tokens.weight", (vocab, h))],
        "head": [("norm.weight", (h,)), ("lm_head.weight", (vocab, h))],
    }


# --- Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json) --------------------------------------------
# hidden_size 2048, num_attention_heads 32, num_key_value_heads 4, head_dim 128, num_experts 128,
# num_experts_per_tok 8, moe_intermediate_size 768, decoder_sparse_step 1 (every block is MoE),
# vocab_size 151936, tie_word_embeddings false; q_norm/k_norm are RMSNorm(head_dim).
def _qwen3_30b_a3b() -> dict[str, Group]:
    h, n_q, n_kv, hd, n_exp, moe, vocab = 2048, 32, 4, 128, 128, 768, 151936
    attn: Group = _linear("self_attn.q_proj", n_q * hd, h)
    attn += _linear("self_attn.k_proj", n_kv * hd, h)
    attn += _linear("self_attn.v_proj", n_kv * hd, h)
    attn += _linear("self_attn.o_proj", h, n_q * hd)
    attn += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    attn += _linear("mlp.gate", n_exp, h)  # router
    norms: Group = [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    # Grouped experts (TorchTitan's GroupedExperts: one 3-D tensor per projection, dim 0 = expert).
    # The MoE block (~623M elements), not the 311M-element vocabulary layer, is the largest group.
    block = attn + [("mlp.experts.w1", (n_exp, moe, h)), ("mlp.experts.w2", (n_exp, h, moe)),
                    ("mlp.experts.w3", (n_exp, moe, h))] + norms
    # HF's per-expert nn.Linear layout: 3 * 128 + 9 = 393 parameters > 256, so TIDE plans refuse
    # it and the group falls back to stock collectives.
    per_expert = list(attn)
    for e in range(n_exp):
        per_expert += _linear(f"mlp.experts.{e}.gate_proj", moe, h)
        per_expert += _linear(f"mlp.experts.{e}.up_proj", moe, h)
        per_expert += _linear(f"mlp.experts.{e}.down_proj", h, moe)
    per_expert += norms
    return {
        "block": block,
        "embedding": [("embed_tokens.weight", (vocab, h))],
        "head": [("norm.weight", (h,)), ("lm_head.weight", (vocab, h))],
        "block_per_expert": per_expert,
    }


# --- Wan2.2-T2V-A14B, one expert (Wan-AI/Wan2.2-T2V-A14B, wan/configs/wan_t2v_A14B.py) ---------
# dim 5120, ffn_dim 13824, num_heads 40, num_layers 40, text_dim 4096, freq_dim 256, in_dim 16,
# out_dim 16, patch_size (1, 2, 2), qk_norm True, cross_attn_norm True. A block: norm1/norm2 are
# LayerNorms without affine parameters, norm3 (cross-attention norm) has weight and bias, every
# attention has biased q/k/v/o and RMSNorm norm_q/norm_k over dim, modulation is (1, 6, dim).
def _wan22_14b() -> dict[str, Group]:
    d, ffn, text, freq, c_in, c_out, patch = 5120, 13824, 4096, 256, 16, 16, (1, 2, 2)
    # A module's own parameters come before its children's, so modulation leads.
    block: Group = [("modulation", (1, 6, d))]
    for attn in ("self_attn", "cross_attn"):
        for proj in ("q", "k", "v", "o"):
            block += _linear(f"{attn}.{proj}", d, d, bias=True)
        block += [(f"{attn}.norm_q.weight", (d,)), (f"{attn}.norm_k.weight", (d,))]
        if attn == "self_attn":
            block += [("norm3.weight", (d,)), ("norm3.bias", (d,))]
    block += _linear("ffn.0", ffn, d, bias=True) + _linear("ffn.2", d, ffn, bias=True)
    # Root module (everything outside the 40 blocks): patch/text/time embeddings, the time
    # projection to 6 modulation vectors, and the output head.
    root: Group = [("patch_embedding.weight", (d, c_in, *patch)), ("patch_embedding.bias", (d,))]
    root += _linear("text_embedding.0", d, text, bias=True) + _linear("text_embedding.2", d, d, True)
    root += _linear("time_embedding.0", d, freq, bias=True) + _linear("time_embedding.2", d, d, True)
    root += _linear("time_projection.1", 6 * d, d, bias=True)
    root += [("head.modulation", (1, 2, d))]
    root += _linear("head.head", c_out * prod(patch), d, bias=True)
    return {"block": block, "root": root}


_BUILDERS = {
    "llama3.1-70b": _llama31_70b,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
    "wan2.2-14b": _wan22_14b,
}
MODELS = tuple(_BUILDERS)
# Groups that make up the model once (block_per_expert is an alternative layout of "block").
_ALTERNATIVES = {"block_per_expert"}


def groups(model: str) -> dict[str, Group]:
    """All named groups of `model`, plus "largest" (the canonical group with the most elements)."""
    try:
        g = _BUILDERS[model]()
    except KeyError:
        raise ValueError(f"model: unknown model {model!r} (expected one of {', '.join(MODELS)})")
    canonical = {k: v for k, v in g.items() if k not in _ALTERNATIVES}
    largest = max(canonical, key=lambda k: sum(prod(s) for _, s in canonical[k]))
    g["largest"] = g[largest]
    return g


def largest_group_name(model: str) -> str:
    g = groups(model)
    return next(k for k, v in g.items() if k != "largest" and v is g["largest"])


def signature(model: str, group: str = "block", **dtypes) -> GroupSignature:
    """GroupSignature of one built-in group; `dtypes` go to GroupSignature (ag_dtype, ...)."""
    g = groups(model)
    if group not in g:
        raise ValueError(f"group: model {model!r} has no group {group!r} "
                         f"(expected one of {', '.join(g)})")
    names = tuple(n for n, _ in g[group])
    shapes = tuple(s for _, s in g[group])
    return GroupSignature(shapes=shapes, names=names, **dtypes)
