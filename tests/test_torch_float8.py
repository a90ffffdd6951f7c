"""torchao's Float8 training with FSDP2's float8 all-gather (``enable_fsdp_float8_all_gather``),
served by TIDE (tide_torch/extensions.py [Note: all-gather extensions]): world 4 on CPU (2 nodes x
2, gloo ranks as processes; torchao's float8 matmuls run there), against stock FSDP2 on identical
per-rank data, parameters bitwise equal, with dynamic scales (an amax all-reduce inside each
pre-all-gather) and with scales precomputed for FSDP
(``precompute_float8_dynamic_scale_for_fsdp``). Every group served; the float8 weights land as
1-byte items (half of bf16's all-gather bytes) where torchao's post-all-gather wraps them.
Skipped where torchao is not installed (CI; the GPU machine gets its wheel). The sizes meet the CUDA
float8 matmul's checks (a CPU test puts every call to them); the GPU case first runs one Float8
block without FSDP or TIDE, and each step of the ranks' run names itself in a failure.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import tide
from _torch_dist import assert_same, mesh_1d, spawn

TOPO = tide.Topology(nodes=2, gpus_per_node=2)
# torch._scaled_mm on CUDA needs the inner dimension of both operands and both dimensions of the
# second a multiple of 16 (torch/_meta_registrations.py, _check_scaled_mm_sizes; the CPU kernel
# checks neither). Float8Linear's weight gradient is grad_output^T @ input, whose inner dimension
# is the token count: TOKENS too must be a multiple of 16 (8 fails on the GPU only).
DIM, HIDDEN, TOKENS = 32, 64, 16


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
        x = torch.randn(TOKENS, DIM, generator=g).to(torch.bfloat16).to(device or "cpu")
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if model._precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


def _versions(device=None) -> str:
    import torchao
    where = "CPU"
    if device is not None and device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        where += f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    return f"torch {torch.__version__}, torchao {torchao.__version__}, {where}"


@contextlib.contextmanager
def _stage(what: str, device=None):
    """Names the step that failed (stock, enable, TIDE's training, the comparison) and the versions,
    so a failure on the GPU machine reads as its cause, not as a bare traceback of one rank."""
    try:
        yield
    except Exception as e:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "-"
        raise RuntimeError(f"float8 test, rank {rank}, {what}: {type(e).__name__}: {e} ({_versions(device)})") from e


def _float8(rank, world, log_dir=None, device=None):
    import tide_torch
    if device is not None:
        from test_torch_gpu import _deterministic
        _deterministic()
    mesh = mesh_1d(device.type if device is not None else "cpu")
    for precompute in (False, True):
        with _stage(f"precompute={precompute}: stock FSDP2 training (no TIDE)", device):
            stock = _model(mesh, precompute, device)
            want = _train(stock, device=device)
        with _stage(f"precompute={precompute}: tide_torch.enable", device):
            model = _model(mesh, precompute, device)
            handle = tide_torch.enable(model, topology=TOPO)
            assert not handle.fallbacks, handle.fallbacks
            float8 = [c for g in handle.groups for c in g.chunks if c.extension]
            assert float8 and all(c.plan.ag_dtype == "uint8" for c in float8), float8
            # 1 byte per element on the wire: half the all-gather bytes of bf16 weights.
            assert all(c.plan.layout.S == sum(pl.e for pl in c.plan.layout.params) for c in float8)
        with _stage(f"precompute={precompute}: training with TIDE", device):
            got = _train(model, device=device)
            handle.synchronize()
        with _stage(f"precompute={precompute}: TIDE against stock", device):
            assert got == want, (got, want)
            s = handle.stats
            assert s["ag_tide"] > 0 and s["rs_tide"] > 0 and s["ag_stock"] == s["rs_stock"] == 0, s
            for name, (planned, ptr) in handle.landings().items():
                assert ptr == planned, name
            assert_same(model, stock, f"float8 precompute={precompute}")
        handle.disable()


def _scaled_mm_calls(device) -> list[tuple]:
    """(a shape, b shape, None or the CUDA check's message) of every torch._scaled_mm call of one
    Float8 Block forward and backward at the test's sizes, without FSDP or TIDE. Each call is also
    put to torch's own shape/layout checks of the CUDA kernel (the meta function on meta tensors
    applies them), wherever it runs."""
    from torch._meta_registrations import _check_scaled_mm_sizes
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    real, calls = torch._scaled_mm, []

    def checked(a, b, *args, **kw):
        try:
            _check_scaled_mm_sizes(meta(a), meta(b), *map(meta, args), **{k: meta(v) for k, v in kw.items()})
            calls.append((tuple(a.shape), tuple(b.shape), None))
        except Exception as e:  # noqa: BLE001 - recorded, the test names it
            calls.append((tuple(a.shape), tuple(b.shape), str(e)))
        return real(a, b, *args, **kw)
    torch.manual_seed(0)
    block = Block().to(device=device, dtype=torch.bfloat16)
    convert_to_float8_training(block, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                                                force_recompute_fp8_weight_in_bwd=False))
    torch._scaled_mm = checked
    try:
        x = torch.randn(TOKENS, DIM, device=device, dtype=torch.bfloat16)
        block(x).float().pow(2).mean().backward()
    finally:
        torch._scaled_mm = real
    return calls


def test_float8_sizes_meet_the_cuda_scaled_mm_checks():
    """The test's model and batch pass the CUDA kernel's checks of every float8 matmul (forward,
    input gradient, weight gradient of both Linears), checked here on the CPU: the GPU case fails
    only for reasons of its own."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    calls = _scaled_mm_calls("cpu")
    assert len(calls) == 6, calls  # 2 Linears x (forward, grad input, grad weight)
    assert all(err is None for _, _, err in calls), calls
    assert (HIDDEN, TOKENS) in [a for a, _, _ in calls]  # the weight gradient: inner dimension = tokens


def test_torchao_float8_all_gather():
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    spawn(_float8)


def _float8_gpu(rank, world, log_dir):
    _float8(rank, world, log_dir, torch.device("cuda", 0))


@pytest.mark.gpu
def test_torchao_float8_all_gather_gpu(tmp_path):
    """The same on one GPU: 2 emulated hosts x 2 ranks (test_torch_gpu.py), stock over NCCL. First,
    in this process, one Float8 Block forward and backward on the GPU without FSDP or TIDE: a
    failure there is torchao's or the GPU's, named as such, before any rank starts."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    from conftest import cuda_missing
    from test_torch_gpu import _cuda_tide, spawn_emulated_hosts
    if not _cuda_tide():
        pytest.skip(cuda_missing() or "no CUDA path here (tide._core.cuda lacks RankExecutor)")
    device = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip(f"float8 matmuls need sm_89 or newer ({_versions(device)})")
    try:
        calls = _scaled_mm_calls(device)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - named, then the test fails
        pytest.fail(f"torchao Float8 forward/backward fails on this GPU without FSDP or TIDE: "
                    f"{type(e).__name__}: {e} ({_versions(device)})")
    bad = [c for c in calls if c[2] is not None]
    assert not bad, f"float8 matmuls off the CUDA kernel's checks: {bad}"
    spawn_emulated_hosts(_float8_gpu, tmp_path)
