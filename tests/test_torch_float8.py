"""torchao's Float8 training with FSDP2's float8 all-gather (``enable_fsdp_float8_all_gather``),
served by TIDE (tide_torch/extensions.py [Note: all-gather extensions]): world 4 on CPU (2 nodes x
2, gloo ranks as processes; torchao's float8 matmuls run there), against stock FSDP2 on identical
per-rank data, parameters bitwise equal, with dynamic scales (an amax all-reduce inside each
pre-all-gather) and with scales precomputed for FSDP
(``precompute_float8_dynamic_scale_for_fsdp``). Every group served; the float8 weights land as
1-byte items (half of bf16's all-gather bytes) where torchao's post-all-gather wraps them.
Skipped where torchao is not installed (CI; the GPU machine gets its wheel).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tide
from _torch_dist import assert_same, mesh_1d, spawn

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
DIM, HIDDEN = 32, 64  # float8 matmuls want multiples of 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _model(mesh, precompute: bool, device=None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)])
    if device is not None:
        model = model.to(device)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                force_recompute_fp8_weight_in_bwd=False)
    convert_to_float8_training(model, config=config)
    model._precompute = precompute
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _train(model, steps: int = 3, device=None) -> list[float]:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, DIM, generator=g).to(torch.bfloat16).to(device or "cpu")
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if model._precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


def _float8(rank, world, log_dir=None, device=None):
    import tide_torch
    if device is not None:
        from test_torch_gpu import _deterministic
        _deterministic()
    mesh = mesh_1d(device.type if device is not None else "cpu")
    for precompute in (False, True):
        stock = _model(mesh, precompute, device)
        want = _train(stock, device=device)
        model = _model(mesh, precompute, device)
        handle = tide_torch.enable(model, topology=TOPO)
        assert not handle.fallbacks, handle.fallbacks
        float8 = [c for g in handle.groups for c in g.chunks if c.extension]
        assert float8 and all(c.plan.ag_dtype == "uint8" for c in float8), float8
        # 1 byte per element on the wire: half the all-gather bytes of bf16 weights.
        assert all(c.plan.layout.S == sum(pl.e for pl in c.plan.layout.params) for c in float8)
        assert _train(model, device=device) == want, precompute
        handle.synchronize()
        s = handle.stats
        assert s["ag_tide"] > 0 and s["rs_tide"] > 0 and s["ag_stock"] == s["rs_stock"] == 0, s
        for name, (planned, got) in handle.landings().items():
            assert got == planned, name
        assert_same(model, stock, f"float8 precompute={precompute}")
        handle.disable()


def test_torchao_float8_all_gather():
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    spawn(_float8)


def _float8_gpu(rank, world, log_dir):
    _float8(rank, world, log_dir, torch.device("cuda", 0))


@pytest.mark.gpu
def test_torchao_float8_all_gather_gpu(tmp_path):
    """The same on one GPU: 2 emulated hosts x 2 ranks (test_torch_gpu.py), stock over NCCL."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    from conftest import cuda_missing
    from test_torch_gpu import _cuda_tide, spawn_emulated_hosts
    if not _cuda_tide():
        pytest.skip(cuda_missing() or "no CUDA path here (tide._core.cuda lacks RankExecutor)")
    spawn_emulated_hosts(_float8_gpu, tmp_path)
