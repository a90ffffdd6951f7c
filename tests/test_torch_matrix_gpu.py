"""The configuration matrix's rows on CUDA (test_torch_matrix.py): 2 emulated hosts x 2 ranks
on one GPU (one NCCL_HOSTID per process, stock FSDP2 and TIDE's rails over NCCL's socket
transport; a node's two ranks reach each other's arenas by CUDA IPC), each against stock FSDP2 on
the same processes: torch's nn.RMSNorm (both modes), reshard_after_forward=2 (backward's
re-gathers over the post-forward pairs), a bf16 reduce dtype, fp16 (an fp16 all-gather, bitwise;
an fp16 reduce dtype: within one fp16 ulp of the fp32-reduce gradients and closer to them than
stock's fp16 NCCL ring on the whole), FSDP2 all-gather extensions (test_torch_extensions.py:
1- and 2-byte outputs, one and two per parameter, both modes), Shard(1) (a Llama block's 2-D
weights and a torchtitan-style MoE's 3-D experts), and TP + FSDP on a dp x tp = 2 x 2
mesh. Every group
served, every all-gather and reduce-scatter through TIDE, parameters bitwise equal to stock on
exact data (bf16 reduce: gradients one rounding of the fp32 sum on per-rank data, no further
from the fp32 reference than stock's bf16 NCCL ring). Correctness and overheads on emulated
hosts, not bandwidth.
"""
from __future__ import annotations

import pytest
import torch

import tide
from _torch_dist import assert_same, batches, build, mesh_1d, train
from test_torch_gpu import _deterministic, needs_cuda_tide, spawn_emulated_hosts
from test_torch_matrix import _grads, _served_everywhere, _tp_model, check_fp16_reduce, check_one_rounding

TOPO = tide.Topology(nodes=2, gpus_per_node=2)


def _trained(model, data, device):
    train(model, data, device=device)
    return model


def _bitwise_row(what, make, stock, data, device, done, mode="in_place", check=None):
    """One row: TIDE (`mode`) on a model from make() trained as `stock` was; every group served,
    every call through TIDE, parameters bitwise equal to stock's. check(handle): the row's own."""
    import tide_torch
    model = make()
    handle = tide_torch.enable(model, mode=mode, topology=TOPO)
    train(model, data, device=device)
    handle.synchronize()
    _served_everywhere(handle, what)
    if check is not None:
        check(handle)
    assert_same(model, stock, what)
    done.append(f"{what} {handle.stats}")
    handle.disable()


def _on_rails(handle):
    assert handle.rails == "two_sided" and handle.transport == "tide-cuda-executor"


def _rows(rank, world, log_dir):
    import tide_torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    _deterministic()
    device = torch.device("cuda", 0)
    mesh = mesh_1d("cuda")
    data = batches(3, same_on_all_ranks=True)
    done = []

    def row(what, make, stock=None, **kw):
        stock = stock if stock is not None else _trained(make(), data, device)
        _bitwise_row(what, make, stock, data, device, done, **kw)

    def rms():
        return build(mesh=mesh, device=device, norm="torch")

    stock = _trained(rms(), data, device)
    for mode in ("in_place", "slot_reuse"):
        row(f"nn.RMSNorm {mode}", rms, stock, mode=mode, check=_on_rails)

    def raf2_check(handle):
        assert handle.stats["ag_post_forward"] == 9, handle.stats

    row("reshard_after_forward=2", lambda: build(mesh=mesh, device=device, reshard_after_forward=2),
        check=raf2_check)

    # (NCCL's bf16 ring rounds after every hop, even on equal inputs: 3a may round; so the
    # check is the one-rounding bound, not bitwise equality with stock.)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    tokens = batches(1, same_on_all_ranks=False)[0]
    ref = _grads(build(mesh=mesh, device=device), tokens)
    stock_g = _grads(build(mesh=mesh, device=device, mp_policy=bf16), tokens)
    model = build(mesh=mesh, device=device, mp_policy=bf16)
    handle = tide_torch.enable(model, topology=TOPO)
    got = _grads(model, tokens)
    handle.synchronize()
    _served_everywhere(handle, "bf16 reduce")
    check_one_rounding(got, stock_g, ref)
    done.append(f"bf16 reduce {handle.stats} one rounding of the fp32 sum, not")
    handle.disable()

    # fp16 all-gather (TIDE-AG's CAST rounds as torch's .to()), gradients reduced in fp32: bitwise.
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    row("fp16 all-gather", lambda: build(mesh=mesh, device=device, mp_policy=fp16))
    # An fp16 reduce dtype: FSDP2's pre-division folded into alpha, one rounding of the fp32 sum.
    ref = _grads(build(mesh=mesh, device=device, mp_policy=fp16), tokens)
    half = MixedPrecisionPolicy(param_dtype=torch.float16)
    stock_g = _grads(build(mesh=mesh, device=device, mp_policy=half), tokens)
    model = build(mesh=mesh, device=device, mp_policy=half)
    handle = tide_torch.enable(model, topology=TOPO)
    got = _grads(model, tokens)
    handle.synchronize()
    _served_everywhere(handle, "fp16 reduce")
    check_fp16_reduce(got, stock_g, ref)
    done.append(f"fp16 reduce {handle.stats} one rounding of the fp32 sum, not")
    handle.disable()

    # FSDP2 all-gather extensions (fp8 / bf16 / fp8 + row scales / bf16 pairs; 1- and 5-argument
    # forms): every pre-all-gather output lands where fsdp_post_all_gather reads it.
    from test_torch_extensions import build_encoded

    def at_planned_landings(handle):
        assert all(got == planned for planned, got in handle.landings().values())

    stock = _trained(build_encoded(mesh, device=device), data, device)
    for mode in ("in_place", "slot_reuse"):
        row(f"all-gather extensions {mode}", lambda: build_encoded(mesh, device=device), stock, mode=mode,
            check=at_planned_landings)

    # Shard(1): a Llama block's 2-D weights and a torchtitan-style MoE's 3-D experts, each rank's
    # columns landing strided (tide/plan.py [Note: Shard(k) as rows]).
    from test_torch_shard_dim import _moe_model, _moe_train, _shard1
    row("Shard(1)", lambda: build(mesh=mesh, device=device, shard_placement_fn=_shard1))
    stock = _moe_model(mesh, device)
    want = _moe_train(stock, data)
    model = _moe_model(mesh, device)
    handle = tide_torch.enable(model, topology=TOPO)
    assert _moe_train(model, data) == want
    handle.synchronize()
    _served_everywhere(handle, "MoE Shard(1)")
    assert_same(model, stock, "MoE Shard(1)")
    done.append(f"MoE Shard(1) experts {handle.stats}")
    handle.disable()

    mesh2 = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    row("TP x FSDP 2x2", lambda: _tp_model(mesh2, colwise_rowwise=True, device=device))
    if rank == 0:
        for line in done:
            print(f"matrix: {line} bitwise", flush=True)


@pytest.mark.gpu
@needs_cuda_tide
def test_matrix_emulated_hosts(tmp_path):
    spawn_emulated_hosts(_rows, tmp_path)
