"""torchtitan's Llama3 debugmodel, sharded by torchtitan's own code, served by TIDE.

World 4 on CPU (gloo ranks as processes), TIDE topology 2 nodes x 2. On each rank the model is
built the way torchtitan's Trainer builds it: ``llama3_configs["debugmodel"]``, the Llama3
sharding config, meta init, ``parallelize_llama`` (``Module.parallelize`` on the SPMD mesh, then
``apply_fsdp_to_decoder``), ``to_empty`` and ``init_weights``. For each ``spmd_backend`` torchtitan
offers (TP 1, FSDP over the 4 ranks): ``"spmd_types"``, its default (every parameter a DTensor on
the full dp_shard x tp storage mesh, the inputs spmd_types-annotated), ``"partial_dtensor"``
(DTensors for model-parallel axes only: FSDP on the flattened ``fsdp`` mesh) and
``"full_dtensor"`` (parameters and inputs DTensors on the full mesh), a stock FSDP2 run and TIDE
runs (In-Place and Slot-Reuse; full_dtensor In-Place only) train on the same tokens on every rank
(exact gradient sums) from the same initial shards, and TIDE did the work: every group served,
every all-gather and reduce-scatter through TIDE (``handle.stats``), no FSDP2 layout op in a
profiled step, parameters bitwise equal to stock.

What a user on CPU changes, and nothing else:
- torchtitan picks its device type from the accelerators present ("cuda" when there are none):
  its meshes are built on "cpu" here (``parallel_dims.device_type``);
- its language-model attention is FlexAttention, which has no CPU backward: each layer's inner
  attention is torchtitan's ``ScaledDotProductAttention`` (causal, no masks; set before the
  sharding config is filled, as ``update_from_config`` would);
- gloo has no PREMUL_SUM: ``set_force_sum_reduction_for_comms(True)`` on every FSDP module
  (stock fails without it too).
- ``Llama3Model.Config.update_from_config`` imports torchtitan's Trainer (datasets, tokenizers,
  loggers): its one effect here (TP 1, no trainer config), ``set_llama3_sharding_config``, is
  called directly.

torchtitan 0.3.0 needs torch 2.15 (it does not import on torch 2.11): the Makefile installs it into
.venv-torch-newest with ``--no-deps`` (requirements/torch-newest-nodeps.txt), and what its model and
parallelize modules import (spmd_types, tyro) from requirements/torch-newest.txt. Without it the
test is skipped, the reason naming what is missing.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

_TORCH = torch.__version__.split("+")[0]
_INSTALL = ("the Makefile installs torchtitan 0.3.0 into .venv-torch-newest (torch 2.15): "
            "requirements/torch-newest-nodeps.txt, its imports in requirements/torch-newest.txt")
try:
    import torchtitan  # noqa: F401
except ImportError:
    _MISSING = f"torchtitan is not installed (torch {_TORCH}); {_INSTALL}"
else:
    try:
        from torchtitan.models.llama3 import llama3_configs  # noqa: F401
        _MISSING = None
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        _MISSING = (f"torchtitan {torchtitan.__version__} does not import on torch {_TORCH} "
                    f"({type(e).__name__}: {e}); {_INSTALL}")

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

import tide  # noqa: E402
from _torch_dist import spawn  # noqa: E402

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
LAYOUT_OPS = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in")
# spmd_backend -> the TIDE modes run: torchtitan's default and the DTensor-for-TP-only backend in
# both modes; its third, full_dtensor (inputs DTensors too), In-Place only.
BACKENDS = {"spmd_types": ("in_place", "slot_reuse"),
            "partial_dtensor": ("in_place", "slot_reuse"),
            "full_dtensor": ("in_place",)}
BATCH, SEQ, STEPS = 2, 16, 3
VOCAB = 2048  # the debugmodel's


_PARALLEL_DIMS: dict = {}


def _titan_model(spmd_backend: str, world: int):
    """The debugmodel, built and sharded as torchtitan's Trainer does (TP 1, FSDP over all
    ranks); returns (model, its forward/backward context (the Trainer's ``train_context``),
    the ParallelDims)."""
    import torchtitan.distributed.parallel_dims as tpd
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.fsdp import FSDPModule
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    tpd.device_type = "cpu"  # torchtitan's default with no accelerator is "cuda"
    parallelism = ParallelismConfig(spmd_backend=spmd_backend)
    training = TrainingConfig(seq_len=SEQ)
    if spmd_backend not in _PARALLEL_DIMS:  # one per job, as the Trainer has: its meshes are
        parallel_dims = ParallelDims.from_config(parallelism, world)  # compared by identity
        parallel_dims.build_mesh()
        _PARALLEL_DIMS[spmd_backend] = parallel_dims
    parallel_dims = _PARALLEL_DIMS[spmd_backend]
    dist_utils.set_spmd_backend(spmd_backend)

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    for layer in cfg.layers:
        # FlexAttention has no CPU backward: torchtitan's SDPA module.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        # The RoPE cache to the training sequence length, as update_from_config does.
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()
    model = parallelize_llama(model, parallel_dims=parallel_dims, training=training,
                              parallelism=parallelism, compile_config=CompileConfig(),
                              ac_config=None, dump_folder="/tmp")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    for m in model.modules():  # gloo has no PREMUL_SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    return model, context, parallel_dims


def _tokens(n: int):
    g = torch.Generator().manual_seed(1)  # the same tokens on every rank: exact gradient sums
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(n)]


def _train(model, context, parallel_dims, data, opt):
    import spmd_types as spmd
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.full_dtensor import parallelize_inputs
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.distributed.utils import get_spmd_backend
    for tokens in data:
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if get_spmd_backend() == "spmd_types":
            inputs, labels, _ = annotate_input_spmd_types(parallel_dims, inputs, labels, {})
        elif get_spmd_backend() == "full_dtensor":
            inputs, labels, _ = parallelize_inputs(parallel_dims, inputs, labels, {})
        with context():
            pred = model(inputs)
            loss = cross_entropy_loss(pred, labels) / labels.numel()
            with spmd.no_typecheck():
                loss.backward()
        opt.step()
        opt.zero_grad()


def _local(model):
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _reshard(model):
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _run(spmd_backend, world, data, init, *, mode=None, profile=False):
    """A model from ``init`` trained on ``data``, the last step under the profiler when
    ``profile`` (stock FSDP2 when ``mode`` is None); returns (this rank's shards after it,
    the handle, the initial shards)."""
    import tide_torch
    model, context, pd = _titan_model(spmd_backend, world)
    if init is None:  # the stock run: its initial shards are the start of every other run
        init = _local(model)
    with torch.no_grad():  # the same start, bitwise
        for n, p in model.named_parameters():
            p.to_local().copy_(init[n])
    handle = tide_torch.enable(model, mode=mode, topology=TOPO) if mode else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _train(model, context, pd, data[:-1], opt)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _train(model, context, pd, data[-1:], opt)
        ops = sorted({e.name for e in prof.events() if any(b in e.name for b in LAYOUT_OPS)})
        assert not ops, (spmd_backend, mode, ops)
    else:
        _train(model, context, pd, data[-1:], opt)
    _reshard(model)
    shards = _local(model)
    if handle is not None:
        handle.disable()
    return shards, handle, init


def _served_everywhere(handle, what):
    report = {"served": f"{len(handle.plans)}/{len(handle.groups)}",
              "fallbacks": handle.fallbacks, "stats": handle.stats,
              "hand_backs": handle.hand_backs,
              "dtensor_groups": [g.fqn for g in handle.groups
                                 if any(fp.is_dtensor for fp in g.pg.fsdp_params)],
              "rs_in_parts": {g.fqn: sorted({str(k[1]) for k in g.sub_plans})
                              for g in handle.groups if g.sub_plans}}
    assert not handle.fallbacks, (what, report)
    s = handle.stats
    assert s["ag_tide"] > 0 and s["rs_tide"] > 0, (what, report)
    assert s["ag_stock"] == 0 and s["rs_stock"] == 0, (what, report)
    return report


def _titan(rank, world, backends):
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
    data = _tokens(STEPS)
    for spmd_backend in backends:
        modes = BACKENDS[spmd_backend]
        ref, _, init = _run(spmd_backend, world, data, None)
        for mode in modes:
            what = (spmd_backend, mode)
            got, handle, _ = _run(spmd_backend, world, data, init, mode=mode,
                                  profile=mode == "in_place")
            report = _served_everywhere(handle, what)
            # tok_embeddings, the 6 layers, [norm, lm_head]: the root holds no parameter of its own
            assert len(handle.groups) == 8, (what, report)
            # What this configuration exercises (what used to send it to stock): spmd_types'
            # (and full_dtensor's) parameters are DTensors on the full SPMD mesh (TP 1) in every
            # group; the blocks' and the [norm, lm_head] group's gradients come in two dtypes
            # (bf16 Linear weights, fp32 RMSNorm weights): their TIDE-RS runs in parts.
            if spmd_backend != "partial_dtensor":
                assert len(report["dtensor_groups"]) == 8, (what, report)
            parts = {f"layers.{i}" for i in range(6)} | {"norm"}
            assert parts <= set(report["rs_in_parts"]), (what, report)
            for name, t in ref.items():
                assert torch.equal(got[name], t), (what, name, (got[name] - t).abs().max())


# full_dtensor runs on ranks of its own: after a spmd_types model in the same process (and vice
# versa) its parameters reach fully_shard as DTensors on the earlier ParallelDims' dp_shard mesh
# (an equal mesh, another object; not traced further), which fully_shard refuses ("Expected
# param's DTensor mesh to be the same mesh passed to fully_shard"), before TIDE is involved.
# The Trainer has one backend per process.
@pytest.mark.parametrize("backends", [("spmd_types", "partial_dtensor"), ("full_dtensor",)],
                         ids="+".join)
def test_torchtitan_llama3_debugmodel(backends):
    spawn(_titan, backends)
