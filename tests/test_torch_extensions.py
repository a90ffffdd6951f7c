"""FSDP2's all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) served by
TIDE (tide_torch/extensions.py [Note: all-gather extensions]): world 4 on CPU (2 nodes x 2, gloo
ranks as processes), each against stock FSDP2 with the same extension on identical per-rank data
(exact gradient sums), parameters bitwise equal.

The extension is this file's own tensor subclass (as FSDP2's own tests have one): a wrapper of
the fp32 master shard whose pre-all-gather emits, per parameter,
- ``fp8``: its float8_e4m3fn cast (one 1-byte output), dequantised after the gather;
- ``bf16``: its bf16 cast (one 2-byte output), which under a bf16 policy *is* the unsharded
  parameter (the post-all-gather returns the gathered output itself: it aliases TIDE's landing);
- ``fp8row``: float8 data with a bf16 power-of-two scale per row (a 1-byte and a 2-byte output of
  different shapes);
- ``split``: a bf16 high part and a bf16 low part (two 2-byte outputs);
in the 1-argument ``(mesh)`` form (torchao 0.18's) and the 5-argument form; all but ``bf16`` ask
torch 2.15 to release the gathered outputs right after the post-all-gather (TIDE's landing stays:
the ring slot is released when the group reshards). Blocks mix extension
weights with plain norm weights, so stock gathers 1-byte groups as uint8 (gloo has no float8).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import tide
from _torch_dist import TinyLlama, assert_same, batches, mesh_1d, spawn, train

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
LAYOUT_OPS = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in")
F8 = torch.float8_e4m3fn


def _encode(codec: str, data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if codec == "fp8":
        return (data.to(F8),)
    if codec == "bf16":
        return (data.to(torch.bfloat16),)
    if codec == "fp8row":
        amax = data.abs().amax(dim=1, keepdim=True).clamp_min(2.0 ** -20)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))  # a power of two: exact in bf16
        return (data.div(scale).to(F8), scale.to(torch.bfloat16))
    hi = data.to(torch.bfloat16)  # "split"
    return (hi, (data - hi.float()).to(torch.bfloat16))


def _decode(codec: str, outputs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    if codec in ("fp8", "bf16"):
        return outputs[0].to(dtype)
    if codec == "fp8row":
        return (outputs[0].float() * outputs[1].float()).to(dtype)
    return (outputs[0].float() + outputs[1].float()).to(dtype)


class Encoded(torch.Tensor):
    """A parameter's local tensor that all-gathers an encoded form of itself."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, codec: str):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                                   dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor, codec: str):
        self._data, self._codec = data, codec

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        """torch 2.15 then frees the outputs right after the post-all-gather: the decoded
        parameter has storage of its own (all but "bf16", which is its gathered output)."""
        return self._codec != "bf16"

    @torch.no_grad()
    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        outputs = tuple(all_gather_outputs)
        value = _decode(self._codec, outputs, param_dtype)
        if out is not None:
            if out.data_ptr() != value.data_ptr():
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(value)
            return None
        return value, (value,)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        codec = None

        def unwrap(x):
            nonlocal codec
            codec = x._codec
            return x._data
        out = func(*pytree.tree_map_only(cls, unwrap, args),
                   **pytree.tree_map_only(cls, unwrap, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, lambda x: cls(x, codec), out)

    def __tensor_flatten__(self):
        return ["_data"], self._codec

    @staticmethod
    def __tensor_unflatten__(inner, codec, outer_size, outer_stride):
        return Encoded(inner["_data"], codec)

    def __repr__(self):
        return f"{type(self).__name__}({self._codec}, {self._data})"


class Encoded1(Encoded):
    """The 1-argument pre-all-gather (torchao 0.18's form)."""

    def fsdp_pre_all_gather(self, mesh):
        return _encode(self._codec, self._data), None


class Encoded5(Encoded):
    """The 5-argument pre-all-gather FSDP2 calls where the extension has it."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return _encode(self._codec, self._data), None


# Per block: the codec (and form) of each Linear weight; norms stay plain parameters.
BLOCKS = (
    {"*": ("fp8", Encoded1)},                                    # one 1-byte output
    {"*": ("bf16", Encoded5)},                                   # one 2-byte output (aliases the landing)
    {"wq": ("fp8row", Encoded1), "wk": ("fp8row", Encoded5), "wv": ("fp8row", Encoded1),
     "wo": ("fp8row", Encoded5), "*": ("split", Encoded5)},      # two outputs per parameter
)


def build_encoded(mesh, device=None) -> nn.Module:
    """TinyLlama with BLOCKS' extension weights, FSDP2 on every block and the root (bf16 policy);
    ``device``: where it lives (initial values drawn on CPU)."""
    from tide_apps.llama import fully_shard_llama
    torch.manual_seed(0)
    model = TinyLlama(len(BLOCKS))
    if device is not None:
        model = model.to(device)
    for block, codecs in zip(model.layers, BLOCKS):
        for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            lin = getattr(block, name)
            codec, cls = codecs.get(name, codecs["*"])
            lin.weight = nn.Parameter(cls(lin.weight.data.clone(), codec))
    return fully_shard_llama(model, mesh)


def _layout_ops(model, data) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(model, data)
    return sorted({e.name for e in prof.events() if any(b in e.name for b in LAYOUT_OPS)})


def _extensions(rank, world):
    import tide_torch
    mesh = mesh_1d()
    data = batches(3, same_on_all_ranks=True)
    stock = build_encoded(mesh)
    train(stock, data[:2])
    stock_ops = _layout_ops(stock, data[2:])
    assert any("all_gather_copy_in" in n for n in stock_ops), stock_ops  # the profile sees stock's copies
    for mode in ("in_place", "slot_reuse"):
        model = build_encoded(mesh)
        handle = tide_torch.enable(model, mode=mode, topology=TOPO)
        assert not handle.fallbacks, handle.fallbacks
        groups = {g.fqn: g for g in handle.groups}
        # One AG item per pre-all-gather output; 1-byte items planned as uint8, in chunks of their own.
        items = {fqn: sum(len(its) for its, ext in zip(g.param_items, g.extension) if ext)
                 for fqn, g in groups.items()}
        assert items == {"layers.0": 7, "layers.1": 7, "layers.2": 14, "<root>": 0}, items
        ext_dtypes = {fqn: sorted({c.plan.ag_dtype for c in g.chunks if c.extension})
                      for fqn, g in groups.items()}
        assert ext_dtypes == {"layers.0": ["uint8"], "layers.1": ["bfloat16"],
                              "layers.2": ["bfloat16", "uint8"], "<root>": []}, ext_dtypes
        assert all(not c.adopts and not c.casts for g in groups.values() for c in g.chunks if c.extension)
        # The reduce-scatter stays over the parameters: bf16 gradients into fp32 shards.
        for g in groups.values():
            assert sorted(p for c in g.rs_chunks for p in c.params) == list(range(len(g.shapes)))
        train(model, data[:2])
        assert _layout_ops(model, data[2:]) == [], mode
        s = handle.stats
        assert s["ag_tide"] > 0 and s["rs_tide"] > 0, s
        assert s["ag_stock"] == 0 and s["rs_stock"] == 0, (s, handle.hand_backs)
        # Every pre-all-gather output landed at its planned address: the all-gather outputs that
        # fsdp_post_all_gather read are TIDE's landing views (no copy-out).
        landings = handle.landings()
        assert "layers.2.wq.weight#1" in landings and "layers.0.wq.weight#1" not in landings
        for name, (planned, got) in landings.items():
            assert got == planned, (mode, name)
        # Under a bf16 policy the "bf16" codec's unsharded parameter is its gathered output:
        # it lives in TIDE's landing, and FSDP2's reshard left that storage alone.
        model.layers[1].unshard()
        fp = next(fp for fp in groups["layers.1"].pg.fsdp_params if fp._param_fqn.endswith("w1.weight"))
        assert fp._unsharded_param.data_ptr() == landings["layers.1.w1.weight#0"][0]
        # The landings of outputs torch 2.15 releases after the post-all-gather keep their storage.
        fp = next(fp for fp in groups["layers.2"].pg.fsdp_params if fp._param_fqn.endswith("wq.weight"))
        assert all(t.untyped_storage().nbytes() == t.numel() * t.itemsize for t in fp.all_gather_outputs)
        assert_same(model, stock, f"extensions {mode}")
        handle.disable()


def test_extensions_bitwise():
    spawn(_extensions)


def _uneven_one_argument(rank, world):
    """An unevenly dim-0-sharded parameter with the 1-argument pre-all-gather returns unpadded
    outputs (ranks' sizes differ): its group keeps stock FSDP2, named, on every rank alike."""
    import tide_torch
    from torch.distributed.fsdp import fully_shard
    mesh = mesh_1d()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 8, bias=False))
    model[0].weight = nn.Parameter(Encoded1(model[0].weight.data.clone(), "bf16"))  # 6 rows over 4
    model[1].weight = nn.Parameter(Encoded5(model[1].weight.data.clone(), "bf16"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = tide_torch.enable(model, topology=TOPO)
    assert set(handle.fallbacks) == {"0"}, handle.fallbacks
    assert "uneven dim-0 shard with the 1-argument" in handle.fallbacks["0"]
    handle.disable()


def test_uneven_one_argument_falls_back():
    spawn(_uneven_one_argument)
