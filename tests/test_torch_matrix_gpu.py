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


def _rows(rank, world, log_dir):
    import tide_torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    _deterministic()
    device = torch.device("cuda", 0)
    mesh = mesh_1d("cuda")
    data = batches(3, same_on_all_ranks=True)
    done = []

    stock = build(mesh=mesh, device=device, norm="torch")
    train(stock, data, device=device)
    for mode in ("in_place", "slot_reuse"):
        model = build(mesh=mesh, device=device, norm="torch")
        handle = tide_torch.enable(model, mode=mode, topology=TOPO)
        assert handle.rails == "two_sided" and handle.transport == "tide-cuda-executor"
        train(model, data, device=device)
        handle.synchronize()
        _served_everywhere(handle, f"nn.RMSNorm {mode}")
        assert_same(model, stock, f"nn.RMSNorm {mode}")
        done.append(f"nn.RMSNorm {mode} {handle.stats}")
        handle.disable()

    stock = build(mesh=mesh, device=device, reshard_after_forward=2)
    train(stock, data, device=device)
    model = build(mesh=mesh, device=device, reshard_after_forward=2)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data, device=device)
    handle.synchronize()
    _served_everywhere(handle, "raf=2")
    assert handle.stats["ag_post_forward"] == 9, handle.stats
    assert_same(model, stock, "raf=2")
    done.append(f"reshard_after_forward=2 {handle.stats}")
    handle.disable()

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
    stock = build(mesh=mesh, device=device, mp_policy=fp16)
    train(stock, data, device=device)
    model = build(mesh=mesh, device=device, mp_policy=fp16)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data, device=device)
    handle.synchronize()
    _served_everywhere(handle, "fp16 all-gather")
    assert_same(model, stock, "fp16 all-gather")
    done.append(f"fp16 all-gather {handle.stats}")
    handle.disable()
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
    stock = build_encoded(mesh, device=device)
    train(stock, data, device=device)
    for mode in ("in_place", "slot_reuse"):
        model = build_encoded(mesh, device=device)
        handle = tide_torch.enable(model, mode=mode, topology=TOPO)
        train(model, data, device=device)
        handle.synchronize()
        _served_everywhere(handle, f"extensions {mode}")
        assert all(got == planned for planned, got in handle.landings().values()), mode
        assert_same(model, stock, f"extensions {mode}")
        done.append(f"all-gather extensions {mode} {handle.stats}")
        handle.disable()

    # Shard(1): a Llama block's 2-D weights and a torchtitan-style MoE's 3-D experts, each rank's
    # columns landing strided (tide/plan.py [Note: Shard(k) as rows]).
    from test_torch_shard_dim import _moe_model, _moe_train, _shard1
    stock = build(mesh=mesh, device=device, shard_placement_fn=_shard1)
    train(stock, data, device=device)
    model = build(mesh=mesh, device=device, shard_placement_fn=_shard1)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data, device=device)
    handle.synchronize()
    _served_everywhere(handle, "Shard(1)")
    assert_same(model, stock, "Shard(1)")
    done.append(f"Shard(1) {handle.stats}")
    handle.disable()
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
    stock = _tp_model(mesh2, colwise_rowwise=True, device=device)
    train(stock, data, device=device)
    model = _tp_model(mesh2, colwise_rowwise=True, device=device)
    handle = tide_torch.enable(model, topology=TOPO)
    train(model, data, device=device)
    handle.synchronize()
    _served_everywhere(handle, "TP + FSDP")
    assert_same(model, stock, "TP + FSDP")
    done.append(f"TP x FSDP 2x2 {handle.stats}")
    handle.disable()
    if rank == 0:
        for line in done:
            print(f"matrix: {line} bitwise", flush=True)


@pytest.mark.gpu
@needs_cuda_tide
def test_matrix_emulated_hosts(tmp_path):
    spawn_emulated_hosts(_rows, tmp_path)
