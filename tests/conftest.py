import os

import pytest


def cuda_missing() -> str:
    """What keeps the CUDA path from running here, named exactly ("" when nothing does): the one
    source of the "gpu" marker's skip reason."""
    try:
        from tide import _core
    except Exception as e:  # noqa: BLE001 - an unbuilt core also means "no GPU path"
        return f"tide._core does not import ({type(e).__name__}: {e}); build it with tools/build.sh"
    if not _core.cuda.built:
        return "tide._core was built without CUDA (TIDE_CUDA=off, or no nvcc at build time)"
    if _core.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return f"no CUDA GPU visible (tide._core.cuda.device_count() == 0: cudaGetDeviceCount found none{hint})"
    return ""


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a CUDA device is usable (tools/gpu/run.py on the GPU machine)."""
    missing = cuda_missing()
    slow = os.environ.get("TIDE_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and missing:
            item.add_marker(pytest.mark.skip(reason=missing))
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow opt-in run: set TIDE_SLOW=1"))


def _tide_segments() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("tide")}
    except OSError:  # no /dev/shm (not Linux)
        return set()


def _live_children() -> set:
    """This process's child processes that have not exited (zombies left for their reaper), less
    multiprocessing's own long-lived helpers (its forkserver and resource tracker)."""
    me, out = os.getpid(), set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] in ("Z", "X") or int(fields[1]) != me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmd or b"multiprocessing.resource_tracker" in cmd:
            continue
        out.add(int(d))
    return out


@pytest.fixture
def no_leaks():
    """The hardening matrix's after-check: a test leaves no /dev/shm/tide* segment and no live
    child process behind (children get a moment to finish exiting)."""
    import time
    shm, kids = _tide_segments(), _live_children()
    yield
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and (_tide_segments() - shm or _live_children() - kids):
        time.sleep(0.05)
    assert not _tide_segments() - shm, f"left in /dev/shm: {sorted(_tide_segments() - shm)}"
    assert not _live_children() - kids, f"child processes outlived the test: {sorted(_live_children() - kids)}"
