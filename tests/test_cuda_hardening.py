"""Hardening on CUDA. The arena: a plan whose arena exceeds the device's free memory is refused
before anything is allocated. The CUDA executor's staging race canary (exec/cuda/staging_canary.h), the GPU twin of the CPU
executor's (test_rs_programs.py): with the static checker bypassed, a program set whose pushers
skip their staging waits (an early staging reuse) or whose owners skip their push waits (a
missing push fence) fails the call naming the race; correct programs under heavy slot reuse, a
stalled rank and several calls never trip it and stay bitwise equal to the CPU cluster.
Run on the GPU machine (python3 tools/gpu/run.py suite, or executor)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
import tide  # noqa: E402
from tide import _core  # noqa: E402
from tide.plan import rs_bank  # noqa: E402
from rs_helpers import programs_without_waits  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)


def _plan(M, L, **kw):
    shapes = [(5 * M * L + 3, 8), (7,), (16 * M * L, 2)]  # a padded last row, a tiny param
    return tide.plan(tide.GroupSignature(shapes=shapes), tide.Topology(M, L), "in_place", n_part=1, **kw)


def _grads(plan, world, seed):
    rng = np.random.default_rng(seed)
    return [[rng.integers(-4, 4, size=s).astype(BF16) for s in _core.plan_shapes(plan)] for _ in range(world)]


def _dev(a):
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).cuda()


def _canary_executor(plan, progs, seed):
    """An in-process CUDA executor with the canary over one GPU, and the RS bindings of integer
    gradients (seed) and zeroed outputs: (executor, bindings, keep-alive tensors)."""
    N = plan.layout.N
    fab = _core.cuda.InProcessFabric([0] * N, progs.arena_bytes())
    ex = _core.cuda.ClusterExecutor(fab, options={"timeout_s": 5.0, "staging_canary": True})
    grads = [[_dev(g) for g in row] for row in _grads(plan, N, seed)]
    outs = [torch.zeros(plan.layout.E, dtype=torch.float32, device="cuda") for _ in range(N)]
    binds = [[(_core.buf_kinds["grad"], p, g.data_ptr(), 2 * g.numel()) for p, g in enumerate(grads[r])]
             + [(_core.buf_kinds["out"], -1, outs[r].data_ptr(), 4 * outs[r].numel())] for r in range(N)]
    return ex, binds, (grads, outs)


def _run_bad(M, L, opts, tag, who, stall_rank):
    plan = _plan(M, L, **opts)
    assert plan.rs_schedule.n_chunks > 2
    N = M * L
    bad = programs_without_waits(plan, who, tag)
    ex, binds, keep = _canary_executor(plan, bad[0], 5)
    ex.set_faults(stall_rank=stall_rank, stall_s=0.3)  # makes the race certain, whatever the timing
    seq = 1
    with pytest.raises(RuntimeError) as e:
        ex.run(bad[rs_bank(seq)], seq, binds)
        ex.synchronize()
    with pytest.raises(RuntimeError, match="fail-stop"):
        ex.run(bad[rs_bank(seq + 1)], seq + 1, binds)  # the executor refuses further calls
    del keep
    return str(e.value), seq


@pytest.mark.parametrize("M,L,opts,tag,who,stall,why", [
    (1, 4, dict(chunk_bytes=16, n_stg=1), "StagingWait", range(1, 4), 0, "early staging reuse"),
    (1, 4, dict(chunk_bytes=16), "PushWait", range(4), 1, "missing push fence"),
    (2, 4, dict(chunk_bytes=16, n_stg=1), "StagingWait", range(8), 0, "early staging reuse"),
    (2, 4, dict(chunk_bytes=16), "PushWait", range(8), 1, "missing push fence"),
])
def test_staging_races_are_caught_by_the_cuda_canary(M, L, opts, tag, who, stall, why):
    """A stalled owner with its pushers' staging waits dropped: a push overwrites a unit its SUM
    has not read. A stalled pusher with the owners' push waits dropped: a SUM reads a slot its
    push has not filled. Either fails synchronize() naming op, seq, slot and ranks."""
    msg, seq = _run_bad(M, L, opts, tag, who, stall)
    assert why in msg and "staging-canary" in msg and f"seq {seq}" in msg, msg
    assert msg.startswith("rank ") and " op " in msg and "staging slot" in msg, msg
    if why == "missing push fence":
        assert f"before rank {stall}'s" in msg, msg  # the stalled pusher is named
    else:  # any owner may be the one overrun (the pushers race every SUM), the stalled one surely is
        assert "COPY" in msg and "overwrites unit " in msg and "before rank " in msg, msg


@pytest.mark.parametrize("M,L,opts", [
    (1, 8, dict(chunk_bytes=16, n_stg=1)), (1, 4, dict(chunk_bytes=64, n_stg=2)),
    (2, 4, dict(chunk_bytes=16, n_stg=1)), (2, 2, dict(chunk_bytes=32, n_stg=3)), (3, 2, {}),
])
def test_correct_programs_never_trip_the_canary(M, L, opts):
    """Heavy slot reuse (every unit on one slot), both banks over several calls, a stalled owner
    and a stalled pusher: the canary stays silent and the bytes equal the CPU cluster's."""
    topo = tide.Topology(M, L)
    plan = _plan(M, L, **opts)
    cpu = tide.VirtualCluster(topo, backend="cpu")
    gpu = tide.VirtualCluster(topo, backend="cuda", options=tide.ExecutorOptions(staging_canary=True))
    assert gpu.backend == "cuda"
    for call in range(4):  # banks alternate; tags advance across calls
        grads = _grads(plan, topo.world, 11 + call)
        want = cpu.reduce_scatter(plan, grads)
        got = gpu.reduce_scatter(plan, [[_dev(g) for g in row] for row in grads], poison=True)
        for r in range(topo.world):
            assert got[r].contiguous().view(torch.uint8).cpu().numpy().tobytes() == \
                np.ascontiguousarray(want[r]).view(np.uint8).tobytes(), (call, r)


@pytest.mark.parametrize("stall_rank", [0, 1])
def test_a_stalled_rank_alone_is_no_race(stall_rank):
    """Lateness is not a race: a stalled owner or pusher with every wait in place passes."""
    M, L = 1, 4
    plan = _plan(M, L, chunk_bytes=16, n_stg=1)
    N = M * L
    good = {b: _core.build_rs_programs(plan, bank=b) for b in (0, 1)}
    ex, binds, (grads, outs) = _canary_executor(plan, good[0], 3)  # grads stay alive: bound
    ex.set_faults(stall_rank=stall_rank, stall_s=0.2)
    for seq in (1, 2, 3):
        ex.run(good[rs_bank(seq)], seq, binds)
        ex.synchronize()
    want = tide.VirtualCluster(tide.Topology(M, L), backend="cpu").reduce_scatter(plan, _grads(plan, N, 3))
    for r in range(N):
        assert np.array_equal(outs[r].cpu().numpy(), want[r]), r


def test_rank_executor_refuses_the_canary():
    """The canary needs every rank in this process: a CUDA rank executor names the option."""
    fab = _core.cuda.IpcFabric(0, 1, 0, 1 << 20)
    with pytest.raises(ValueError, match="staging_canary"):
        _core.cuda.RankExecutor(fab, rank=0, nodes=1, gpus_per_node=1, options={"staging_canary": True})


def test_an_arena_above_free_device_memory_is_refused_naming_its_largest_region():
    """A plan whose arena cannot fit the GPU is refused before anything is allocated, naming the
    device's free bytes and the largest region (here staging: many large slots)."""
    free, _ = torch.cuda.mem_get_info(0)
    with pytest.raises(ValueError, match=r"exceed the \d+ bytes free there"):
        _core.cuda.InProcessFabric([0, 0], free // 2 + (1 << 30))
    rows = int(free * 0.17) // 8  # bf16 (rows, 4): an arena of about 3.5x that per rank, 2 ranks: 1.2x free
    plan = tide.plan(tide.GroupSignature(shapes=[(rows, 4)]), tide.Topology(1, 2))
    assert 2 * _core.session_arena(plan, ["all_gather", "reduce_scatter"])[1] > free
    vc = tide.VirtualCluster(tide.Topology(1, 2), backend="cuda")
    shards = [[torch.zeros(plan.layout.params[0].e, dtype=torch.bfloat16, device="cuda")] for _ in range(2)]
    with pytest.raises(ValueError, match=r"bytes free there.*the largest region is '\w+'"):
        vc.all_gather(plan, shards)
    del shards, vc
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info(0)[0] >= free - (256 << 20)  # no arena was left allocated
