"""tide_torch on CUDA: TIDE's programs through tide._core.cuda.RankExecutor over the CUDA-IPC
fabric of the ranks' arenas, 5 AdamW steps of the tiny Llama with MixedPrecisionPolicy(bf16, fp32),
both modes.

(a) world 1 on cuda:0: parameters and losses bitwise equal to stock FSDP2 (exact data), every
    unsharded parameter at its planned landing address, no _chunk_cat / split_with_sizes_copy /
    all_gather_copy_in in the profiler. The same check runs on CPU (TIDE's CPU executor) here.
(b) world 2 on ONE GPU (two processes, one arena each, opened through CUDA IPC). NCCL refuses two
    ranks on one GPU, so the process group is gloo. TIDE needs no stock collective when every
    group is eligible (asserted: rs_stock == ag_stock == 0, and the profiler sees no c10d / gloo
    op in a TIDE step; test_world2_cpu checks the same on CPU); the stock FSDP2 reference on the
    same GPU gets its all-gather / reduce-scatter through gloo on host copies (custom FSDP2 comms).
    Bitwise on exact data; random data within fp32 tolerance (a 2-rank sum is exact in either
    order, so it is expected bitwise too); and an fp32-policy run (in-place shard adoption) with
    SGD within fp32 tolerance of the same training on CPU (gloo, CPU) — GPU and CPU matmuls
    differ in summation order, so CPU vs GPU is never bitwise.
(c) with two GPUs: world 2 over NCCL, TIDE vs stock FSDP2 bitwise on exact data, both modes.
(d) enable(fabric="nccl"): the arena is a tide._core.cuda.NcclFabric's (views at its arena_ptr, the
    pointer the executor resolves); (a)'s claims at world 1 on cuda:0, and (c)'s on two GPUs;
    disable() closes the fabric on every rank.

Each GPU case runs with deterministic algorithms, so stock and TIDE compute identical gradients.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import tide
from _torch_dist import batches, build, local_shards, mesh_1d, spawn, train
from conftest import cuda_missing

STEPS = 5
MODES = ("in_place", "slot_reuse")
BANNED = ("split_with_sizes_copy", "_chunk_cat", "chunk_cat", "all_gather_copy_in")


def _cuda_tide() -> bool:
    try:
        from tide_torch import comm
        return comm.cuda_executor_available()
    except Exception:  # noqa: BLE001 - no CUDA build: no CUDA path
        return False


needs_cuda_tide = pytest.mark.skipif(
    not _cuda_tide(), reason=cuda_missing() or "no CUDA path here: tide_torch.comm.cuda_executor_available() is "
                                               "False (tide._core.cuda lacks RankExecutor / IpcFabric)")


def _nccl_fabric_missing() -> str | None:
    try:
        from tide_torch.arena import nccl_fabric_api_error
        return nccl_fabric_api_error()
    except Exception as e:  # noqa: BLE001 - no CUDA build: no NCCL fabric
        return f"{type(e).__name__}: {e}"


needs_nccl_fabric = pytest.mark.skipif(
    _nccl_fabric_missing() is not None, reason=f"no NCCL fabric here: {_nccl_fabric_missing()}")


def _deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _check_tide_run(handle, model, ref, losses, ref_losses, what, *, exact=True):
    handle.synchronize()  # raises the CUDA executor's errors, if any
    assert not handle.fallbacks, (what, handle.fallbacks)
    stats = handle.stats
    assert stats["ag_tide"] > 0 and stats["rs_tide"] > 0, (what, stats)
    assert stats["ag_stock"] == 0 and stats["rs_stock"] == 0, (what, stats)
    if handle.mode == "in_place" and handle.topology.world > 1:
        assert stats["ag_early"] > 0, (what, stats)  # [Note: early backward all-gather]
    got = local_shards(model)
    for name, t in ref.items():
        if exact:
            assert torch.equal(got[name], t), (what, name, (got[name] - t).abs().max())
        else:
            torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{what} {name}: {m}")
    if exact:
        assert losses == ref_losses, (what, losses, ref_losses)
    landings = handle.landings()
    assert len(landings) == sum(1 for _ in model.parameters()), what
    for name, (planned, got_ptr) in landings.items():
        assert got_ptr == planned, (what, name, hex(planned), got_ptr)


def _op_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def _train_profiled(model, data, device, **kw):
    """train() in three calls (1 step, 1 profiled step, the rest): the losses and the op names
    of the profiled step. References train the same way (each call starts a fresh AdamW)."""
    losses = train(model, data[:1], device=device, **kw)
    names = _op_names(lambda: losses.extend(train(model, data[1:2], device=device, **kw)))
    losses += train(model, data[2:], device=device, **kw)
    return losses, names


def _pg_collectives(names: set[str]) -> list[str]:
    """Process-group collectives among profiler event names (c10d ops, gloo / NCCL work)."""
    return sorted(n for n in names if n.startswith(("c10d::", "gloo:", "nccl:")))


# ---- (a) world 1 -------------------------------------------------------------------------------

def _check_nccl_arena(handle):
    """The arena sits on the NCCL fabric, and views use the pointer the executor resolves."""
    arena = handle._rt.arena
    assert isinstance(arena.fabric, tide._core.cuda.NcclFabric), type(arena.fabric)
    assert arena.fabric_kind == "nccl" and not arena.fabric.closed
    assert arena.base_ptr == arena.fabric.arena_ptr != 0, (arena.base_ptr, arena.fabric.arena_ptr)
    assert arena.fabric.local_arena_ptr != 0 and arena.fabric.arena_bytes >= arena.nbytes
    assert arena.fabric.world == handle.topology.world
    return arena.fabric


def _world1(rank, world, device_type, fabric="auto"):
    import tide_torch
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        _deterministic()
    mesh = mesh_1d(device_type)
    data = batches(STEPS, same_on_all_ranks=True)
    stock = build(mesh=mesh, device=device)
    stock_losses, names = _train_profiled(stock, data, device)
    assert [n for n in names if "chunk_cat" in n], sorted(names)  # the check below means something
    ref = local_shards(stock)
    for mode in MODES:
        model = build(mesh=mesh, device=device)
        handle = tide_torch.enable(model, mode=mode, fabric=fabric, serve_single_rank=True)
        expected = "tide-cuda-executor" if device_type == "cuda" else "tide-executor"
        assert handle.transport == expected, handle.transport
        assert handle.fabric == (None if device_type == "cpu" else
                                 "ipc" if fabric == "auto" else fabric), handle.fabric
        nccl = _check_nccl_arena(handle) if fabric == "nccl" else None
        assert handle.memory()["regions"]["stage"] == 0  # never all-gathered at world 1
        losses, names = _train_profiled(model, data, device)
        assert not [n for n in names if any(b in n for b in BANNED)], (mode, sorted(names))
        _check_tide_run(handle, model, ref, losses, stock_losses,
                        f"world 1 {device_type} {mode} fabric={fabric}")
        handle.disable()
        assert nccl is None or nccl.closed


def test_world1_cpu():
    spawn(_world1, "cpu", world=1)


def _world1_default(rank, world):
    """Without serve_single_rank a one-rank job keeps stock FSDP2: every group falls back with
    one log line in all, nothing is patched, and training is stock's."""
    import logging

    import tide_torch
    from tide_torch import _patches
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tide_torch").addHandler(handler)
    mesh = mesh_1d("cpu")
    data = batches(STEPS, same_on_all_ranks=True)
    stock_losses, _ = _train_profiled(build(mesh=mesh), data, torch.device("cpu"))
    model = build(mesh=mesh)
    handle = tide_torch.enable(model)
    fallbacks = handle.fallbacks
    assert fallbacks and all("single-rank job" in why for why in fallbacks.values()), fallbacks
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "serve_single_rank=True" in warned[0], warned
    assert not _patches.installed()
    losses, _ = _train_profiled(model, data, torch.device("cpu"))
    assert losses == stock_losses, (losses, stock_losses)
    handle.disable()
    with pytest.raises(TypeError, match="serve_single_rank"):
        tide_torch.enable(build(mesh=mesh), serve_single_rank="yes")


def test_world1_keeps_stock_by_default():
    spawn(_world1_default, world=1)


@pytest.mark.gpu
@needs_cuda_tide
def test_world1_cuda():
    spawn(_world1, "cuda", world=1, cuda_devices=(0,), start_method="spawn")


@pytest.mark.gpu
@needs_nccl_fabric
def test_world1_cuda_nccl_fabric():
    spawn(_world1, "cuda", "nccl", world=1, cuda_devices=(0,), start_method="spawn")


def _world2_cpu(rank, world):
    """(b)'s claims on CPU ranks: at world 2 every sum is exact (a + b, scaled by 1/2), so TIDE
    matches stock FSDP2 bitwise on any data, and a TIDE step issues no process-group collective
    (stock's does)."""
    import tide_torch
    topo = tide.Topology(nodes=1, gpus_per_node=2)
    mesh = mesh_1d()
    for exact in (True, False):
        data = batches(STEPS, same_on_all_ranks=exact)
        stock = build(mesh=mesh)
        stock_losses, names = _train_profiled(stock, data, None)
        assert _pg_collectives(names), sorted(names)
        ref = local_shards(stock)
        for mode in MODES:
            model = build(mesh=mesh)
            handle = tide_torch.enable(model, mode=mode, topology=topo)
            losses, names = _train_profiled(model, data, None)
            assert not _pg_collectives(names), (mode, _pg_collectives(names))
            _check_tide_run(handle, model, ref, losses, stock_losses,
                            f"CPU world 2 exact={exact} {mode}")
            handle.disable()


def test_world2_cpu():
    spawn(_world2_cpu, world=2)


# ---- (b) world 2 on one GPU, gloo --------------------------------------------------------------

def _host_comms(model) -> None:
    """Stock FSDP2 on CUDA ranks whose process group is gloo: its all-gather / reduce-scatter go
    through gloo on host copies, on FSDP2's own streams (everything else stays stock)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class HostAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
            dist.all_gather_into_tensor(out, input_tensor.cpu(), group=group)
            output_tensor.copy_(out)
            return None

    class HostReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
            dist.reduce_scatter_tensor(out, input_tensor.cpu(), op=op, group=group)
            output_tensor.copy_(out)
            return None

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(HostAllGather())
            m.set_custom_reduce_scatter(HostReduceScatter())


def _one_gpu_world2(rank, world):
    import tide_torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    _deterministic()
    device = torch.device("cuda", 0)
    topo = tide.Topology(nodes=1, gpus_per_node=2)
    mesh = mesh_1d("cuda")
    for exact in (True, False):
        data = batches(STEPS, same_on_all_ranks=exact)
        stock = build(mesh=mesh, device=device)
        _host_comms(stock)
        stock_losses, names = _train_profiled(stock, data, device)
        assert _pg_collectives(names), sorted(names)  # the check below means something
        ref = local_shards(stock)
        for mode in MODES:
            model = build(mesh=mesh, device=device)
            handle = tide_torch.enable(model, mode=mode, topology=topo)
            assert handle.transport == "tide-cuda-executor", handle.transport
            losses, names = _train_profiled(model, data, device)
            # No process-group collective in a TIDE step: gloo never sees a CUDA tensor.
            assert not _pg_collectives(names), (mode, _pg_collectives(names))
            _check_tide_run(handle, model, ref, losses, stock_losses,
                            f"1 GPU world 2 exact={exact} {mode}", exact=exact)
            assert handle.stats["graph_launches"] == 0, handle.stats  # graphs are opt-in
            handle.disable()
        # Calls replayed as CUDA graphs (exec/cuda/graph.h): the same bits, and replays happened
        # (an all-gather's buffers repeat every step; a reduce-scatter's when the allocator
        # hands its gradients the same addresses).
        model = build(mesh=mesh, device=device)
        handle = tide_torch.enable(model, mode="in_place", topology=topo,
                                   executor_options=tide.ExecutorOptions(graphs=True))
        losses, _ = _train_profiled(model, data, device)
        _check_tide_run(handle, model, ref, losses, stock_losses, f"1 GPU world 2 exact={exact} graphs",
                        exact=exact)
        stats = handle.stats
        assert stats["graph_captures"] > 0 and stats["graph_launches"] > stats["graph_captures"], stats
        handle.disable()

    # fp32 parameters (in-place shard adoption: the all-gather reads the shards in the arena),
    # SGD: same GPU bitwise, and within fp32 tolerance of the same training on CPU.
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    data = batches(STEPS, same_on_all_ranks=True)
    cpu = build(mesh=mesh_1d("cpu"), mp_policy=fp32)
    cpu_losses = train(cpu, data, optimizer="sgd")
    cpu_ref = local_shards(cpu)
    stock = build(mesh=mesh, device=device, mp_policy=fp32)
    _host_comms(stock)
    stock_losses = train(stock, data, device=device, optimizer="sgd")
    ref = local_shards(stock)
    model = build(mesh=mesh, device=device, mp_policy=fp32)
    handle = tide_torch.enable(model, mode="slot_reuse", topology=topo)
    assert handle.memory()["regions"]["resident"] > 0
    losses = train(model, data, device=device, optimizer="sgd")
    _check_tide_run(handle, model, ref, losses, stock_losses, "1 GPU world 2 fp32 adopted")
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-4, atol=1e-5)
    for name, t in local_shards(model).items():
        torch.testing.assert_close(t, cpu_ref[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"CUDA vs CPU {name}: {m}")
    handle.disable()


@pytest.mark.gpu
@needs_cuda_tide
def test_world2_one_gpu_ipc():
    spawn(_one_gpu_world2, world=2, backend="gloo", cuda_devices=(0, 0), start_method="spawn")


# ---- (c) world 2 on two GPUs, NCCL -------------------------------------------------------------

def _two_gpus(rank, world, fabric="auto"):
    import tide_torch
    _deterministic()
    device = torch.device("cuda", rank)
    topo = tide.Topology(nodes=1, gpus_per_node=2)
    mesh = mesh_1d("cuda")
    data = batches(STEPS, same_on_all_ranks=True)
    stock = build(mesh=mesh, device=device)
    stock_losses = train(stock, data, device=device)
    ref = local_shards(stock)
    for mode in MODES:
        model = build(mesh=mesh, device=device)
        handle = tide_torch.enable(model, mode=mode, topology=topo, fabric=fabric)
        assert handle.transport == "tide-cuda-executor", handle.transport
        assert handle.fabric == ("ipc" if fabric == "auto" else fabric), handle.fabric
        nccl = None
        if fabric == "nccl":
            nccl = _check_nccl_arena(handle)
            assert nccl.lsa_size == 2 and nccl.peer_arena_ptr(1 - rank) != 0  # peers by LSA
        losses = train(model, data, device=device)
        _check_tide_run(handle, model, ref, losses, stock_losses,
                        f"2 GPUs NCCL {mode} fabric={fabric}")
        handle.disable()
        assert nccl is None or nccl.closed


@pytest.mark.gpu
@needs_cuda_tide
def test_world2_two_gpus_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    spawn(_two_gpus, world=2, backend="nccl", cuda_devices=(0, 1), start_method="spawn")


@pytest.mark.gpu
@needs_nccl_fabric
def test_world2_two_gpus_nccl_fabric():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    spawn(_two_gpus, "nccl", world=2, backend="nccl", cuda_devices=(0, 1), start_method="spawn")


# ---- the CUDA transport's calls into tide._core, checked on CPU -------------------------------

class _RecordingExecutor:
    """Stands in for tide._core.cuda.RankExecutor: records its construction."""

    def __init__(self, fabric, rank, nodes, gpus_per_node, *, regions, options):
        self.args = (fabric, rank, nodes, gpus_per_node)
        self.regions, self.options, self.syncs = regions, options, 0

    def synchronize(self):
        self.syncs += 1


class _RecordingSession:
    """Stands in for tide._core.GroupSession: records its placement and every call (the bytes are
    moved by the real sessions in the GPU tests above; the per-call state is the core's)."""

    made: list = []

    def __init__(self, plan, executor, kinds, **placement):
        self.plan, self.executor, self.kinds, self.placement, self.calls = plan, executor, kinds, placement, []
        _RecordingSession.made.append(self)

    def all_gather(self, buffers, streams):
        self.calls.append(("ag", buffers, streams))

    def reduce_scatter(self, alpha, accumulate, buffers, streams):
        self.calls.append(("rs", alpha, accumulate, buffers, streams))


def test_cuda_transport_calls(monkeypatch):
    """What CudaExecutorTransport hands the core: one session per (group, collective, plan) with
    the group's placement and counter ranges, this rank's buffers and torch's current stream."""
    from types import SimpleNamespace

    from tide_torch import comm, placement
    from tide_torch.arena import Arena
    from tide_torch.groups import Chunk, TideGroup

    sig = tide.GroupSignature(shapes=[(37, 16), (16,), (24, 16)], ag_dtype="bfloat16",
                              grad_dtype="bfloat16", shard_dtype="float32")
    topo = tide.Topology(nodes=1, gpus_per_node=2)
    tg = TideGroup(index=1, fqn="layers.0", is_root=False, world=2, topology=topo,
                   pg=SimpleNamespace(post_forward_mesh_info=object(),
                                      reshard_after_backward=True),
                   ag_dtypes=[torch.bfloat16] * 3, shard_dtypes=[torch.float32] * 3,
                   shapes=[(37, 16), (16,), (24, 16)])
    tg.set_chunks([Chunk(0, (0, 1, 2), tide.plan(sig, topo, mode="in_place"), torch.bfloat16, torch.float32)])
    arena = Arena(placement.assign([tg]), torch.device("cpu"))
    shm_name = arena.shm_name
    try:
        placement.bind([tg], arena)
        assert tg.counter_bases == {"ag": 0, "rs": tide._core.program_counters(tg.plan, "all_gather")}
        arena.shm_name, arena.fabric = None, "the fabric"  # as on CUDA
        monkeypatch.setattr(tide._core.cuda, "RankExecutor", _RecordingExecutor)
        monkeypatch.setattr(tide._core, "GroupSession", _RecordingSession)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=77))
        _RecordingSession.made.clear()
        opts = tide.ExecutorOptions(timeout_s=7.0)
        t = comm.make_transport(arena, [None, None], 1, topo, group_of=None, options=opts)
        assert isinstance(t, comm.CudaExecutorTransport) and t.name == "tide-cuda-executor"
        ex = t._exec
        regions = {r.name: (r.offset, r.nbytes) for r in arena.regions.values()}
        assert ex.args == ("the fabric", 1, 1, 2) and ex.regions == regions
        assert ex.options == opts.as_dict()

        layout = tg.plan.layout
        shards = [torch.zeros(pl.e) for pl in layout.params]
        t.all_gather(tg, shards, tg.landing_views)
        t.all_gather(tg, shards, tg.landing_views)
        grads = [torch.zeros(s) for s in tg.shapes]
        out = torch.zeros(layout.E)
        t.reduce_scatter(tg, tg.plan, "rs", grads, out, 0.5)
        t.reduce_scatter(tg, tg.plan, "rs", grads, out, 0.5)
        t.synchronize()
        assert ex.syncs == 1
        ag, rs = _RecordingSession.made  # one session per collective, made at its first call
        assert ag.kinds == ["all_gather"] and rs.kinds == ["reduce_scatter"]
        assert ag.executor is ex and rs.executor is ex
        assert ag.placement == dict(group=1, counter_bases={"all_gather": 0}, members=None, ring_slot=0,
                                    resident=False, landing_region=tg.slot,
                                    landing_offset=tg.chunks[0].unsharded_offset - regions[tg.slot][0],
                                    resident_offset=0, pull_landing=True)  # one node, a cast: pulls
        assert rs.placement == dict(group=1, counter_bases={"reduce_scatter": tg.counter_bases["rs"]},
                                    members=None)
        shard = dict(tide._core.buf_kinds)["shard"]
        landing = dict(tide._core.buf_kinds)["landing"]  # the rank's own landing views ([Note: pull landing])
        want = [[(shard, p, s.data_ptr(), 4 * s.numel()) for p, s in enumerate(shards)]
                + [(landing, p, v.data_ptr(), 2 * v.numel()) for p, v in enumerate(tg.landing_views)]]
        assert ag.calls == [("ag", want, [77])] * 2
        kinds = dict(tide._core.buf_kinds)
        (_, alpha, acc, buffers, streams), second = rs.calls
        assert (alpha, acc, streams) == (0.5, False, [77]) and second[1:] == (0.5, False, buffers, [77])
        assert buffers[0][-1] == (kinds["out"], -1, out.data_ptr(), 4 * layout.E)
        assert [b[:2] for b in buffers[0][:-1]] == [(kinds["grad"], p) for p in range(3)]
    finally:
        arena.shm_name, arena.fabric = shm_name, None
        arena.close()


class _StandInNccl:
    """What Arena asks of a tide._core.cuda.NcclFabric once built (test_nccl_arena_calls)."""

    def __init__(self):
        self.closed, self.closes = False, 0

    def close(self):
        self.closes += 1
        self.closed = True


def test_nccl_arena_calls():
    """An arena on the NCCL fabric, checked on CPU: sizes padded to the agreed total, no IPC
    handle and no open_peers step, close_fabric() closes the fabric once; no NCCL arena on CPU."""
    from tide.regions import arena_nbytes
    from tide_torch.arena import Arena

    sizes = {"ring0": 1000, "ring1": 0, "fixed": 300, "resident": 0, "stage": 0}
    assert arena_nbytes(sizes) == 1024 + 512
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="the NCCL fabric needs CUDA, the arena's device is cpu"):
        Arena(sizes, cpu, nccl=_StandInNccl())
    with pytest.raises(ValueError, match="nbytes 1000 is below the regions' 1536 bytes"):
        Arena(sizes, cpu, nbytes=1000)
    arena = Arena(sizes, cpu, nbytes=4096)
    fabric = _StandInNccl()
    try:
        assert arena.nbytes == 4096 and arena.regions["fixed"].offset == 1024
        assert arena.view(4096 - 8, 2, torch.float32).numel() == 2  # the padding is arena too
        arena.fabric, arena.fabric_kind = fabric, "nccl"  # as on CUDA
        assert arena.ipc_handle() is None
        arena.open_peers([None, None])  # nothing to open: the fabric maps its LSA peers itself
        arena.close_fabric()
        arena.close_fabric()
        assert fabric.closes == 1 and arena.closed
        with pytest.raises(RuntimeError, match="arena is closed"):
            arena.view(0, 1, torch.float32)
    finally:
        arena.fabric = arena.fabric_kind = None
        arena.close()
    # The CUDA-IPC fabric still exchanges and opens handles, and is freed with its last view.
    ipc = Arena(sizes, cpu)
    opened = []
    fabric.handle = lambda: b"h" * 64
    fabric.open_peers = opened.append
    ipc.fabric, ipc.fabric_kind = fabric, "ipc"
    assert ipc.ipc_handle() == b"h" * 64
    with pytest.raises(RuntimeError, match=r"ranks \[1\] have no CUDA-IPC arena handle"):
        ipc.open_peers([b"a", None])
    ipc.open_peers([b"a", b"b"])
    assert opened == [[b"a", b"b"]]
    ipc.close_fabric()
    assert fabric.closes == 1 and ipc.closed


# ---- (d) 2 emulated hosts x 2 ranks on one GPU: two-sided rails over NCCL ------------------------
# One NCCL_HOSTID per process: NCCL takes every rank for a host of its own and carries the stock
# process group and TIDE's rail over its network transport (NET/Socket on loopback); a node's two
# ranks reach each other's arenas by CUDA IPC (same GPU). Never NVLS / multicast.
EMULATED_HOSTS = dict(NCCL_HOSTID="tide-emulated-host-{rank}", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                      NCCL_SOCKET_IFNAME="lo", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET",
                      NCCL_DEBUG_FILE="{log_dir}/nccl.{rank}.%p.log")


def _emulated_hosts_2x2(rank, world, log_dir):
    import tide_torch
    _deterministic()
    device = torch.device("cuda", 0)
    topo = tide.Topology(nodes=2, gpus_per_node=2)
    mesh = mesh_1d("cuda")
    data = batches(STEPS, same_on_all_ranks=True)
    stock = build(mesh=mesh, device=device)
    stock_losses = train(stock, data, device=device)
    ref = local_shards(stock)
    for mode in MODES:
        model = build(mesh=mesh, device=device)
        handle = tide_torch.enable(model, mode=mode, topology=topo)
        assert handle.rails == "two_sided" and handle.transport == "tide-cuda-executor", (handle.rails,
                                                                                         handle.transport)
        fab = handle._rt.arena.fabric  # host isolation: only this node's arenas are mapped
        assert all(bool(fab.peer_arena_ptr(r)) == (r // 2 == rank // 2) for r in range(world) if r != rank)
        losses = train(model, data, device=device)
        _check_tide_run(handle, model, ref, losses, stock_losses, f"emulated 2x2 {mode}")
        if mode == "in_place":
            _report_rail_cost(handle, model, stock, data, device, rank)
        handle.disable()


def _step_ms(model, data, device, reps=3):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    train(model, data[:reps], device=device)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


def _report_rail_cost(handle, model, stock, data, device, rank):
    """Rank 0 prints one 'rails:' line: step time of TIDE and stock on the emulated cluster (socket
    bound: overheads, not bandwidth) and the rail kernels' time and SM*ms in one TIDE step."""
    tide_ms, stock_ms = _step_ms(model, data, device), _step_ms(stock, data, device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        train(model, data[:1], device=device)
        torch.cuda.synchronize()
    rail_us = sum(e.device_time for e in prof.events() if e.name.startswith("ncclDevKernel"))
    ctas = handle._rt.rail.max_ctas
    if rank == 0:
        print(f"rails: emulated 2x2 step tide {tide_ms:.1f} ms stock {stock_ms:.1f} ms; rail kernels "
              f"{rail_us / 1e3:.2f} ms per step on <= {ctas} SMs = {ctas * rail_us / 1e3:.2f} SM*ms", flush=True)


def spawn_emulated_hosts(fn, tmp_path, world=4):
    """fn(rank, world, log_dir) on `world` processes sharing GPU 0, each an emulated host
    (EMULATED_HOSTS; NCCL's logs under tmp_path)."""
    env = {k: v.replace("{log_dir}", str(tmp_path)) for k, v in EMULATED_HOSTS.items()}
    spawn(fn, str(tmp_path), world=world, backend="nccl", cuda_devices=(0,) * world,
          start_method="spawn", env=env)


@pytest.mark.gpu
@needs_cuda_tide
def test_emulated_hosts_2x2_rails(tmp_path):
    spawn_emulated_hosts(_emulated_hosts_2x2, tmp_path)
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("nccl.*.log"))
    assert "tide-rail" in logs or "NET/Socket" in logs, logs[-2000:]
    assert "NET/Socket" in logs, "the rail's traffic does not go over NCCL's socket transport"
