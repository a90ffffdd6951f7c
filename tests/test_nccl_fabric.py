"""NcclFabric (csrc/fabric/nccl.h): NCCL loaded at run time, the arena in an NCCL symmetric window,
peers by LSA pointer, a rail communicator, an agreed capability probe.

CPU (CI): tide._core imports; arguments are refused by name before NCCL or a GPU is touched; no GPU
is a clear error; the loader names a missing library, a missing symbol and a major.minor mismatch
with the headers (fake libraries in a subprocess). GPU (tools/gpu/run.py nccl): world 1 -- the arena
is zeroed, arena(0) (the LSA pointer) aliases the ncclMemAlloc pointer, the rail communicator has
size 1, the probe is agreed, and CudaRankExecutor over the fabric at 1 x 1 runs TIDE-AG and TIDE-RS
bit-equal to the CPU VirtualCluster; world 2 (two processes, one GPU each; needs two GPUs) -- the
same at 1 x 2, and a disagreeing probe field makes both ranks raise the same error.
"""
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import subprocess
import sys
import textwrap
import time
import traceback

import numpy as np
import pytest

from tide import _core
from test_cuda_ipc import _calls_raw, _check_bitwise, _layout, _plan, reaped

HEADERS = _core.cuda.nccl_header_version()
needs_headers = pytest.mark.skipif(HEADERS == 0, reason="tide._core has no NCCL fabric (built without CUDA or NCCL headers)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version_str(code):
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


# ---- CPU ------------------------------------------------------------------------------------------
def test_core_imports_and_names_the_nccl_surface():
    for name in ("NcclFabric", "nccl_unique_id", "nccl_version", "nccl_header_version"):
        assert hasattr(_core.cuda, name), name
    if _core.built_with_cuda and HEADERS:
        assert HEADERS >= 22800, HEADERS
        doc = _core.cuda.RankExecutor.__init__.__doc__
        assert "fabric: tide._core.cuda.NcclFabric" in doc and "fabric: tide._core.cuda.IpcFabric" in doc, doc


@pytest.mark.skipif(HEADERS != 0, reason="this build has the NCCL fabric")
def test_without_headers_the_fabric_says_so():
    with pytest.raises(_core.PlanError, match="built without NCCL headers|has no CUDA executor"):
        _core.cuda.NcclFabric(0, 1, 0, 4096, b"\0" * 128)


@needs_headers
@pytest.mark.parametrize("args,kw,match", [
    ((2, 2, 0, 4096, b"\0" * 128), {}, r"rank 2 is outside \[0, 2\)"),
    ((-1, 2, 0, 4096, b"\0" * 128), {}, r"rank -1 is outside \[0, 2\)"),
    ((0, 0, 0, 4096, b"\0" * 128), {}, "world must be >= 1, got 0"),
    ((0, 1, 0, 4096, b"\0" * 127), {}, "unique_id has 127 bytes, an ncclUniqueId has 128"),
    ((0, 4, 0, 4096, b"\0" * 128), {"gpus_per_node": 3}, "gpus_per_node 3 does not divide world 4"),
    ((0, 4, 0, 4096, b"\0" * 128), {"gpus_per_node": 0}, "gpus_per_node 0 does not divide world 4"),
    ((0, 1, 0, 0, b"\0" * 128), {}, "arena_bytes must be positive, got 0"),
    ((0, 1, -1, 4096, b"\0" * 128), {}, "device must be >= 0, got -1"),
])
def test_bad_arguments_are_named_before_anything_is_touched(args, kw, match):
    with pytest.raises(_core.PlanError, match=match):
        _core.cuda.NcclFabric(*args, **kw)


@needs_headers
def test_unique_id_is_128_fresh_bytes():
    a, b = _core.cuda.nccl_unique_id(), _core.cuda.nccl_unique_id()
    assert isinstance(a, bytes) and len(a) == len(b) == 128
    assert a != b
    assert _core.cuda.nccl_version() // 100 == HEADERS // 100


@needs_headers
@pytest.mark.skipif(_core.cuda.available(), reason="a CUDA device is usable here")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(_core.PlanError, match=r"NcclFabric: device 0 is not a usable CUDA device \(0 visible\)"):
        _core.cuda.NcclFabric(0, 1, 0, 4096, _core.cuda.nccl_unique_id())


# The loader, in a fresh interpreter (nothing loaded yet, so RTLD_NOLOAD finds nothing), with the
# nvidia.nccl wheel hidden and TIDE_NCCL_LIBRARY pointing at a fake library.
REQUIRED = ["ncclGetUniqueId", "ncclCommInitRank", "ncclCommDestroy", "ncclCommAbort", "ncclCommSplit",
            "ncclCommCount", "ncclCommUserRank", "ncclGetErrorString", "ncclGetLastError", "ncclMemAlloc",
            "ncclMemFree", "ncclCommWindowRegister", "ncclCommWindowDeregister", "ncclAllReduce", "ncclTeamLsa",
            "ncclCommInitRankConfig", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
            "ncclCommGetAsyncError"]


def _fake_nccl(tmp_path, version, omit=()):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a fake libnccl")
    src = tmp_path / "fake.c"
    body = [f"int ncclGetVersion(int* v) {{ *v = {version}; return 0; }}"]
    body += [f"int {n}(void) {{ return 1; }}" for n in REQUIRED if n not in omit]
    src.write_text("\n".join(body) + "\n")
    lib = tmp_path / "libnccl_fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)


def _in_fresh_python(code, library):
    env = dict(os.environ, TIDE_NCCL_LIBRARY=library, PYTHONPATH=REPO)
    prog = "import sys\nsys.modules['nvidia'] = None\nfrom tide import _core\n" + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@needs_headers
def test_major_minor_mismatch_is_refused_naming_the_abi(tmp_path):
    lib = _fake_nccl(tmp_path, 23203)
    out = _in_fresh_python("""
        print(_core.cuda.nccl_version())
        try:
            _core.cuda.nccl_unique_id()
        except _core.Error as e:
            print("ERR", e)
        try:
            _core.cuda.NcclFabric(0, 1, 0, 4096, b"\\0" * 128)
        except _core.Error as e:
            print("ERR", e)
    """, lib)
    lines = out.splitlines()
    assert lines[0] == "23203", out
    errs = [l for l in lines if l.startswith("ERR")]
    assert len(errs) == 2, out
    for e in errs:
        assert f"is 2.32.3 but tide was built against NCCL {_version_str(HEADERS)} headers" in e, e
        assert "major.minor must match" in e and "device ABI" in e and "between 2.28 and 2.32" in e, e
        assert "libnccl_fake.so" in e, e


@needs_headers
def test_missing_symbol_is_named(tmp_path):
    lib = _fake_nccl(tmp_path, HEADERS, omit=("ncclCommWindowRegister",))
    out = _in_fresh_python("""
        try:
            _core.cuda.nccl_version()
        except _core.Error as e:
            print("ERR", e)
    """, lib)
    assert "does not export ncclCommWindowRegister (NCCL >= 2.27 needed)" in out, out


@needs_headers
def test_no_library_is_a_clear_error(tmp_path):
    out = _in_fresh_python("""
        import ctypes
        try:
            ctypes.CDLL("libnccl.so.2")
            print("ON_PATH")
        except OSError:
            pass
        for f in (_core.cuda.nccl_version, _core.cuda.nccl_unique_id, lambda: _core.cuda.NcclFabric(0, 1, 0, 4096, b"\\0" * 128)):
            try:
                f()
            except _core.Error as e:
                print("ERR", str(e).splitlines()[0])
    """, str(tmp_path / "absent" / "libnccl.so.2"))
    if "ON_PATH" in out:
        pytest.skip("libnccl.so.2 is on the loader's path here")
    errs = [l for l in out.splitlines() if l.startswith("ERR")]
    assert len(errs) == 3, out
    assert all("NCCL is not available: no libnccl.so.2 could be loaded" in e for e in errs), out


@needs_headers
@pytest.mark.skipif(_core.cuda.available(), reason="sets NCCL_NVLS_ENABLE=1: CPU machines only (GPU safety rule)")
def test_nvls_on_with_the_multicast_gate_closed_is_refused(tmp_path):
    # A fake libnccl (no real NCCL is loaded) and no GPU: the refusal comes before either is used.
    out = _in_fresh_python("""
        import os
        os.environ.pop("TIDE_ENABLE_MULTICAST", None)
        os.environ["NCCL_NVLS_ENABLE"] = "1"
        try:
            _core.cuda.NcclFabric(0, 1, 0, 4096, b"\\0" * 128)
        except _core.PlanError as e:
            print("ERR", e)
    """, _fake_nccl(tmp_path, HEADERS))
    assert "ERR NcclFabric: NCCL_NVLS_ENABLE=1 but the multicast gate is closed" in out, out


# ---- GPU, world 1 ----------------------------------------------------------------------------------
class _Collect:
    """The `conn` of test_cuda_ipc's rank bodies, in-process."""

    def __init__(self):
        self.msgs = []

    def send(self, m):
        self.msgs.append(m)


def _fabric1(nbytes):
    return _core.cuda.NcclFabric(0, 1, 0, nbytes, _core.cuda.nccl_unique_id(), gpus_per_node=1)


@pytest.mark.gpu
def test_world1_arena_zeroed_lsa_pointer_aliases_rail_probe():
    nbytes = 3 * 4096 + 100  # not a multiple of 4 KiB: the window is rounded up, arena_bytes is not
    fab = _fabric1(nbytes)
    try:
        lsa, local = fab.arena_ptr, fab.local_arena_ptr
        assert lsa and local and fab.peer_arena_ptr(0) == lsa
        assert fab.is_local(0) and fab.device_of(0) == 0 and fab.world == 1 and fab.arena_bytes == nbytes
        assert (fab.lsa_size, fab.lsa_rank) == (1, 0)
        assert (fab.rail_size, fab.rail_rank) == (1, 0)
        assert _core.cuda.d2h(local, nbytes) == bytes(nbytes), "arena not zeroed (local pointer)"
        assert _core.cuda.d2h(lsa, nbytes) == bytes(nbytes), "arena not zeroed (LSA pointer)"
        rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
        a = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        _core.cuda.h2d(local, a)
        assert _core.cuda.d2h(lsa, nbytes) == a, "a write through ncclMemAlloc's pointer is not seen via the LSA one"
        b = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        _core.cuda.h2d(lsa + 17, b[17:])
        assert _core.cuda.d2h(local, nbytes) == a[:17] + b[17:], "a write through the LSA pointer is not seen locally"
        v = _core.cuda.nccl_version()
        assert fab.probe == {"nccl_version": v, "header_version": HEADERS, "multicast_allowed": 0,
                             "arena_bytes": nbytes, "gpus_per_node": 1, "lsa_team_size": 1}, fab.probe
        assert fab.rail_put_path == ("put_signal" if v >= 22900 else "send_recv")
    finally:
        fab.close()
    assert fab.closed and fab.arena_ptr == 0 and fab.peer_arena_ptr(0) == 0
    fab.close()  # idempotent


@pytest.mark.gpu
def test_world1_rank_executor_ag_rs_match_the_virtual_cluster():
    _, plan = _plan(1, 1, False)
    regions, nbytes = _layout(plan)
    seed = int.from_bytes(os.urandom(4), "little") % 100000
    cfg = dict(M=1, L=1, cast=False, seed=seed, regions=regions, nbytes=nbytes)
    fab = _fabric1(nbytes)
    try:
        ex = _core.cuda.RankExecutor(fab, 0, 1, 1, regions=regions, timeout_s=10.0)
        conn = _Collect()
        _calls_raw(0, cfg, fab, ex, plan, conn)
        conn.send(("stats", (ex.cached_program_sets, ex.runs_started)))
        del ex
    finally:
        fab.close()
    _check_bitwise(1, 1, cfg, {0: conn.msgs})


# ---- GPU, world 2 (two processes, one GPU each) ----------------------------------------------------
def _gpu_count():
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return _core.cuda.device_count()


two_gpus = pytest.mark.skipif(_core.cuda.available() and _gpu_count() < 2, reason="needs two GPUs")


def _rank_main(rank, cfg, conn):
    try:
        if rank == 0:
            conn.send(("uid", _core.cuda.nccl_unique_id()))
        uid = conn.recv()
        try:
            fab = _core.cuda.NcclFabric(rank, 2, rank, cfg["nbytes"], uid, gpus_per_node=cfg["gpus_per_node"][rank])
        except _core.PlanError as e:
            conn.send(("raised", str(e)))
            conn.send(("done", None))
            return
        assert (fab.lsa_size, fab.lsa_rank) == (2, rank), (fab.lsa_size, fab.lsa_rank)
        assert all(fab.peer_arena_ptr(r) for r in range(2)) and fab.peer_arena_ptr(rank) == fab.arena_ptr
        assert (fab.rail_size, fab.rail_rank) == (1, 0)
        assert fab.probe["lsa_team_size"] == 2 and fab.probe["gpus_per_node"] == 2, fab.probe
        _, plan = _plan(1, 2, False)
        ex = _core.cuda.RankExecutor(fab, rank, 1, 2, regions=cfg["regions"], timeout_s=10.0)
        _calls_raw(rank, cfg, fab, ex, plan, conn)
        conn.send(("stats", (ex.cached_program_sets, ex.runs_started)))
        del ex
        conn.send(("closing", None))
        conn.recv()  # every rank has finished with every arena: the collective teardown
        fab.close()
        conn.send(("done", None))
    except BaseException:  # noqa: BLE001 - report to the parent
        conn.send(("error", traceback.format_exc()))


def _run_two(gpus_per_node):
    _, plan = _plan(1, 2, False)
    regions, nbytes = _layout(plan)
    seed = int.from_bytes(os.urandom(4), "little") % 100000
    cfg = dict(M=1, L=2, cast=False, seed=seed, regions=regions, nbytes=nbytes, gpus_per_node=gpus_per_node)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, pipes[r][1]), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    conns = [p[0] for p in pipes]
    got, done, closing = {0: [], 1: []}, set(), set()
    deadline = time.monotonic() + 180
    with reaped(procs):
        while len(done) < 2:
            left = deadline - time.monotonic()
            assert left > 0, f"ranks hung: done {sorted(done)}, got {got}"
            for c in mpc.wait([c for r, c in enumerate(conns) if r not in done], timeout=left):
                r = conns.index(c)
                tag, val = c.recv()
                assert tag != "error", f"rank {r}:\n{val}"
                if tag == "uid":
                    for c2 in conns:
                        c2.send(val)
                elif tag == "closing":
                    closing.add(r)
                    if len(closing) == 2:
                        for c2 in conns:
                            c2.send("close")
                elif tag == "done":
                    done.add(r)
                else:
                    got[r].append((tag, val))
    assert [p.exitcode for p in procs] == [0, 0], "teardown hung or crashed"
    return cfg, got


@pytest.mark.gpu
@two_gpus
def test_world2_rank_executor_ag_rs_match_the_virtual_cluster():
    cfg, got = _run_two([2, 2])
    _check_bitwise(1, 2, cfg, got)


@pytest.mark.gpu
@two_gpus
def test_world2_disagreeing_probe_field_raises_on_both_ranks():
    _, got = _run_two([1, 2])  # rank 0 says one GPU per node, rank 1 two
    msgs = [[v for tag, v in got[r] if tag == "raised"] for r in range(2)]
    assert all(len(m) == 1 for m in msgs), got
    assert msgs[0] == msgs[1], msgs
    assert "disagree on capability probe field 'gpus_per_node': min 1, max 2 over 2 ranks" in msgs[0][0], msgs

