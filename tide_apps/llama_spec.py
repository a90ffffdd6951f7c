"""What examples/fsdp2_llama.py (PyTorch) and examples/flax_fsdp.py (JAX) share, so that both
train the same Llama-style model: the size presets, the initial weights, the tokens and the
optimizer's hyperparameters (`tide bench train` reads the presets too). numpy only: importing it
pulls in neither torch nor jax.

The model (written once per framework: torch in tide_apps/llama.py, JAX in
examples/flax_fsdp.py): token embedding (vocab, dim); per block
RMSNorm, grouped-query attention (wq, wk, wv, wo; causal, no positional encoding), RMSNorm and a
SwiGLU MLP (w2(silu(w1 x) * w3 x)); a final RMSNorm and an untied output head. Linear weights
are (out_features, in_features) as nn.Linear stores them, in both frameworks, so both shard the
same dim 0. Mixed precision is FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32): fp32 master weights, bf16 compute, RMSNorm statistics in fp32, fp32 logits
into the cross entropy.
"""
from __future__ import annotations

import argparse

import numpy as np

# vocab, dim, layers, heads, kv_heads, hidden; batch: sequences per rank (device), seq: tokens
SIZES = {
    "tiny": dict(vocab=503, dim=64, layers=4, heads=8, kv_heads=2, hidden=172, batch=4, seq=32),
    "small": dict(vocab=32000, dim=1024, layers=8, heads=16, kv_heads=4, hidden=2816, batch=4,
                  seq=1024),
    "1b": dict(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192, batch=4,
               seq=2048),  # Llama-3.2-1B's shapes
}
FIELDS = tuple(SIZES["tiny"])
RMS_EPS = 1e-6
# torch.optim.AdamW's defaults with lr 1e-3; optax.adamw takes the same numbers (its own default
# weight decay is 1e-4, torch's 1e-2). Both decay every parameter, norms and embedding included.
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def emulated_host_env(process: int) -> dict[str, str]:
    """NCCL's launch variables for process `process` of a job whose processes share one GPU, each
    an emulated host: its own NCCL_HOSTID, so NCCL accepts several ranks on one GPU and carries
    their traffic over its socket transport on loopback (correctness and overheads, not
    bandwidth). Multicast stays off."""
    return dict(NCCL_HOSTID=f"tide-emulated-host-{process}", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                NCCL_SOCKET_IFNAME="lo", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")


def add_args(ap: argparse.ArgumentParser) -> None:
    """--size, one override per preset field (--vocab, --dim, ..., --batch, --seq) and --seed."""
    ap.add_argument("--size", default="tiny", choices=tuple(SIZES),
                    help="model and batch preset (default tiny; 1b: Llama-3.2-1B's shapes)")
    for k in FIELDS:
        what = "sequences per rank (device)" if k == "batch" else k
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None,
                        help=f"override the size preset's {what}")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and tokens")


def resolve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills the fields the command line left to the --size preset; ap.error()s on bad shapes."""
    for k, v in SIZES[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in FIELDS:
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.dim % args.heads or args.heads % args.kv_heads:
        ap.error(f"--dim {args.dim} / --heads {args.heads} / --kv-heads {args.kv_heads}: heads "
                 "must divide dim and kv-heads must divide heads")
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")


def describe(cfg, world: int) -> dict:
    """The "model" entry of an example's --json: what must match for two runs to be comparable
    (`tide bench train` checks it across frameworks)."""
    return dict({k: getattr(cfg, k) for k in FIELDS}, size=cfg.size, seed=cfg.seed,
                global_batch=cfg.batch * world,
                parameters=sum(int(np.prod(s)) for _, s, _ in param_specs(cfg)))


def param_specs(cfg) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every parameter in torch's named_parameters() order; init is
    "normal" (nn.Embedding: N(0, 1)), "uniform" (nn.Linear: U(-1/sqrt(in), 1/sqrt(in))) or
    "ones" (RMSNorm)."""
    hd = cfg.dim // cfg.heads
    out = [("tok_embeddings.weight", (cfg.vocab, cfg.dim), "normal")]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        out += [(p + "attention_norm.weight", (cfg.dim,), "ones"),
                (p + "wq.weight", (cfg.heads * hd, cfg.dim), "uniform"),
                (p + "wk.weight", (cfg.kv_heads * hd, cfg.dim), "uniform"),
                (p + "wv.weight", (cfg.kv_heads * hd, cfg.dim), "uniform"),
                (p + "wo.weight", (cfg.dim, cfg.heads * hd), "uniform"),
                (p + "ffn_norm.weight", (cfg.dim,), "ones"),
                (p + "w1.weight", (cfg.hidden, cfg.dim), "uniform"),
                (p + "w2.weight", (cfg.dim, cfg.hidden), "uniform"),
                (p + "w3.weight", (cfg.hidden, cfg.dim), "uniform")]
    out += [("norm.weight", (cfg.dim,), "ones"), ("output.weight", (cfg.vocab, cfg.dim), "uniform")]
    return out


def init_weights(cfg, seed: int):
    """Yields (name, float32 array) in param_specs order, drawn from one numpy generator seeded
    with (seed, 0): the same bytes for both frameworks and every rank. A generator, so that a
    caller can load each array and drop it (the 1b preset is 5 GB in fp32)."""
    rng = np.random.default_rng([seed, 0])
    for name, shape, init in param_specs(cfg):
        if init == "ones":
            yield name, np.ones(shape, np.float32)
        elif init == "normal":
            yield name, rng.standard_normal(shape, dtype=np.float32)
        else:
            bound = np.float32(1.0 / np.sqrt(shape[1]))
            yield name, (rng.random(shape, dtype=np.float32) * 2 - 1) * bound


def token_batches(cfg, steps: int, global_batch: int, seed: int) -> list[np.ndarray]:
    """`steps` int32 batches of shape (global_batch, seq + 1), from a generator seeded with
    (seed, 1). Learnable data: each sequence counts up from a random start (mod vocab), so the
    loss falls within a few steps. Rank (device) r of W trains on rows [r B, (r + 1) B), B =
    global_batch / W; inputs are [:, :-1], targets [:, 1:]."""
    rng = np.random.default_rng([seed, 1])
    ramp = np.arange(cfg.seq + 1)
    return [((rng.integers(0, cfg.vocab, (global_batch, 1)) + ramp) % cfg.vocab).astype(np.int32)
            for _ in range(steps)]
