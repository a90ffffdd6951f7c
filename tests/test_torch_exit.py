"""tide_torch at process exit: no tide._core instance is left for interpreter shutdown.

nanobind prints ``nanobind: leaked N instances!`` (and the leaked types and functions) when its
internals are torn down at the very end of interpreter finalization while instances of its types
are still alive. Each rank here is a plain subprocess (its stderr captured) that runs TIDE on three
models of the tiny Llama, then exits normally:

- ``disabled``: trained, then ``handle.disable()``; model and handle stay in ``__main__``;
- ``live``: trained, never disabled, model and handle in ``__main__`` (freed by module teardown);
- ``pinned``: trained, never disabled, and model and handle given a reference nobody releases
  (as tensors held by torch's C++ side, or by a user's global that outlives module teardown, are):
  only the exit hook (tide_torch/runtime.py [Note: runtime lifetime]) releases its core objects.

Every rank must exit 0, its own exit check (registered before tide_torch is imported, so it runs
after tide_torch's hook) must find every runtime released with its transport closed and its
arena's fabric dropped, and its stderr must not contain ``leaked``. On CPU the arenas are shared
memory (the core's RankExecutor / CpuRankExecutor / GroupSession / Plan instances are what could
leak); the GPU twin runs world 2 on one GPU over gloo with the CUDA-IPC fabric (IpcFabric, CUDA
RankExecutor; the views' storages reference the fabric, see tide_torch/arena.py
[Note: fabric lifetime]).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "tide-exit-check"


def _run_ranks(world: int, device_type: str, timeout_s: float = 420.0) -> list[str]:
    """Starts ``world`` rank processes of this file, waits for them, returns their stderr."""
    fd, init_file = tempfile.mkstemp(prefix="tide_exit_pg_")
    os.close(fd)
    os.unlink(init_file)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    procs, errs = [], []
    with tempfile.TemporaryDirectory(prefix="tide_exit_") as d:
        try:
            for rank in range(world):
                err = open(os.path.join(d, f"rank{rank}.err"), "w+")
                errs.append(err)
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), str(rank), str(world), init_file,
                     device_type], stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT))
            codes = [p.wait(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if os.path.exists(init_file):
                os.unlink(init_file)
        texts = []
        for err in errs:
            err.seek(0)
            texts.append(err.read())
            err.close()
    for rank, (code, text) in enumerate(zip(codes, texts)):
        assert code == 0, f"rank {rank} exited {code}; its stderr:\n{text[-6000:]}"
    return texts


def _check(texts: list[str]) -> None:
    for rank, text in enumerate(texts):
        assert f"{MARK} ok rank {rank}" in text, f"rank {rank}'s exit check did not run:\n{text[-6000:]}"
        assert "leaked" not in text, f"rank {rank} leaked tide._core instances at exit:\n{text[-6000:]}"


def test_cpu_ranks_exit_without_leaks():
    _check(_run_ranks(2, "cpu"))


def test_detach_views_keeps_only_open_nccl_fabrics():
    """arena.detach_views() (the exit hook's last step) on stand-in fabrics: views let go of a
    CUDA-IPC fabric (no ``closed``) and of a closed NCCL fabric, and keep an open NCCL one."""
    from tide_torch import arena

    class Ipc:
        pass

    class Nccl:
        def __init__(self, closed):
            self.closed = closed

    fabrics = [Ipc(), Nccl(True), Nccl(False)]
    views = [arena._FabricBytes(f, 4096, 256) for f in fabrics]
    arena.detach_views()
    assert [v.fabric for v in views] == [None, None, fabrics[2]]


def _cuda_tide() -> bool:
    try:
        from tide_torch import comm
        return comm.cuda_executor_available()
    except Exception:  # noqa: BLE001 - no CUDA build: no CUDA path
        return False


@pytest.mark.gpu
def test_gpu_ranks_exit_without_leaks():
    """World 2 on cuda:0 over gloo, CUDA-IPC fabric (as test_torch_gpu.py::test_world2_one_gpu_ipc)."""
    # Checked here, not in a decorator: a rank process (this file as __main__) must import
    # tide_torch only after registering its exit check.
    if not _cuda_tide():
        from conftest import cuda_missing
        pytest.skip(cuda_missing() or "no CUDA path here: tide_torch.comm.cuda_executor_available() "
                                      "is False")
    _check(_run_ranks(2, "cuda"))


# ---- the rank process ------------------------------------------------------------------------

_HELD: list = []  # what the exit check inspects (weak: it must not keep anything alive itself)


def _exit_check(rank: int) -> None:
    """Runs after tide_torch's exit hook (registered before tide_torch is imported)."""
    from tide_torch import runtime
    problems = []
    for name, ref in _HELD:
        rt = ref()
        if rt is None:
            continue
        if not rt.released:
            problems.append(f"{name}: runtime not released")
        if rt.transport is not None and not rt.transport.closed:
            problems.append(f"{name}: transport open")
        if rt.arena is not None and rt.arena.fabric is not None:
            problems.append(f"{name}: arena still holds its fabric")
        if any(g.chunks for g in rt.groups):
            problems.append(f"{name}: plans kept")
    main = sys.modules["__main__"]
    handle = getattr(main, "handle_live", None)
    if handle is not None:
        handle.disable()  # after the exit hook: a no-op (the arena may be gone), never an error
        if handle.enabled:
            problems.append("disable() after the exit hook left the handle enabled")
    left = [rt for rt in list(runtime._RUNTIMES) if not rt.released]
    if left:
        problems.append(f"{len(left)} runtimes not released")
    print(f"{MARK} {'ok' if not problems else 'FAILED: ' + '; '.join(problems)} rank {rank}",
          file=sys.stderr, flush=True)


def _rank(rank: int, world: int, init_file: str, device_type: str) -> None:
    import atexit
    import ctypes
    import weakref

    atexit.register(_exit_check, rank)  # before tide_torch's hook: runs after it
    import torch
    import torch.distributed as dist

    import tide
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(0)  # both ranks on cuda:0 (NCCL refuses that: gloo)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import tide_torch
    from _torch_dist import batches, build, mesh_1d, train
    device = torch.device(device_type, 0) if device_type == "cuda" else None
    mesh = mesh_1d(device_type)
    topo = tide.Topology(nodes=1, gpus_per_node=world)
    data = batches(2, same_on_all_ranks=True)
    main = sys.modules["__main__"]
    for name in ("disabled", "live", "pinned"):
        model = build(mesh=mesh, device=device)
        handle = tide_torch.enable(model, topology=topo)
        want = "tide-cuda-executor" if device_type == "cuda" else "tide-executor"
        assert handle.transport == want, (name, handle.transport)
        train(model, data, device=device)
        assert handle.stats["ag_tide"] > 0 and handle.stats["rs_tide"] > 0, (name, handle.stats)
        if name == "disabled":
            handle.disable()
            assert handle._rt.released and handle._rt.transport.closed
        if name == "pinned":  # never released by anyone: only the exit hook frees TIDE's objects
            for obj in (model, handle):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        setattr(main, f"model_{name}", model)
        setattr(main, f"handle_{name}", handle)
        _HELD.append((name, weakref.ref(handle._rt)))
    # Every rank's TIDE work is done before any rank exits (peers push into each other's arenas;
    # the exit hook has no barrier: docs/tide_torch.md). The hook still synchronizes and frees.
    for name in ("live", "pinned"):
        getattr(main, f"handle_{name}").synchronize()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
