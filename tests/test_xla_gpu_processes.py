"""tide_xla across processes on CUDA: 2 and 4 jax.distributed processes sharing one GPU, as
emulated hosts (one NCCL_HOSTID per process, NCCL's socket transport on loopback).

Each process holds one GPU device (the same GPU); ranks of one topology node reach each other's
arenas by CUDA IPC, other nodes through their NCCL rail ([Note: CUDA rank states] in
ffi/executor_cuda.cc). TIDE-AG forward, the AG+RS gradient of a loss whose gradient every
platform computes to the same bits, and RS with scale and an accumulator: every process's shards
are bitwise the CPU results (one process holding all N ranks as XLA:CPU host devices).
"""
import os

import pytest

from xla_mp_helpers import assert_same_shards, launch

pytest.importorskip("jax")

EMULATED_HOST = dict(JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_P2P_DISABLE="1",
                     NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="lo", NCCL_NVLS_ENABLE="0")


def _cuda_ready() -> str:
    """'' when this machine can run the test, else why not."""
    try:
        import tide_xla._ffi as f
    except ImportError as e:
        return f"tide_xla._ffi is not built: {e}"
    if not f.built_with_cuda:
        return "tide_xla._ffi was built without CUDA"
    if not os.path.exists("/dev/nvidiactl"):
        return "no NVIDIA GPU on this machine"
    return ""


@pytest.mark.gpu
@pytest.mark.parametrize("processes,topology", [
    (2, "1x2"),   # one node: IPC between two processes on one GPU
    (2, "2x1"),   # two emulated hosts: the NCCL rail only
    (4, "2x2"),   # IPC inside a node, rails across
    (4, "4x1"),
])
def test_processes_sharing_a_gpu_equal_the_cpu_results_bitwise(tmp_path, processes, topology):
    why = _cuda_ready()
    if why:
        pytest.skip(why)
    ref = launch(tmp_path / "cpu", 1, "exact", topology,
                 dict(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={processes}"),
                 wait_s=120)
    rc, data, err = ref[0]
    assert rc == 0 and data is not None, err
    res = launch(tmp_path / "gpu", processes, "exact", topology, EMULATED_HOST,
                 per_process=lambda i: {"NCCL_HOSTID": f"tide-xla-host-{i}"}, wait_s=240)
    assert_same_shards(res, data)


@pytest.mark.gpu
def test_a_process_dying_before_its_rail_makes_the_other_raise_naming_it(tmp_path):
    """2 x 1 on one GPU: process 1 publishes its IPC handle and dies before joining the NCCL rail;
    process 0's rail construction (ncclCommInitRankConfig, non-blocking) is aborted at the
    context's deadline (3 s) and raises naming process 1 ([Note: rail deadline])."""
    import re
    why = _cuda_ready()
    if why:
        pytest.skip(why)
    res = launch(tmp_path, 2, "die_at_rail", "2x1", EMULATED_HOST,
                 per_process=lambda i: {"NCCL_HOSTID": f"tide-xla-host-{i}"}, wait_s=120)
    assert res[1][0] == 3, res[1][2]
    rc, _, err = res[0]
    assert rc == 1 and "NCCL rail (group 0) waited 3 s for ranks [1] of processes [1]" in err, err
    took = float(re.search(r"\[raised ([0-9.]+) s after tide_xla.init\]", err).group(1))
    assert took < 3.0 + 10.0, took
