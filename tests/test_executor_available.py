"""tide_xla._ffi.executor_available(kind) tells the truth: compared with independent probes (the
core module's own build flag, and the CUDA driver asked directly through ctypes), so a version
that always answers True (or False) fails here on one machine or the other. The "gpu" marker's
skip reason (tests/conftest.py) is checked against the same probes."""
import ctypes

import pytest

pytest.importorskip("jax")
from tide import _core  # noqa: E402
from tide_xla import _ffi  # noqa: E402

from conftest import cuda_missing  # noqa: E402


def driver_device_count() -> int:
    """CUDA devices as the driver (libcuda, not the CUDA runtime TIDE links) reports them."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0  # no driver: no device
    if lib.cuInit(0) != 0:
        return 0
    n = ctypes.c_int(0)
    return n.value if lib.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


def test_cpu_executor_is_always_available():
    assert _ffi.executor_available("cpu") is True
    assert "CPU" in _ffi.executor_description("cpu")


def test_cuda_executor_available_matches_independent_probes():
    built = bool(_core.cuda.built)
    assert bool(_ffi.built_with_cuda) == built  # one build: both modules agree
    expected = built and driver_device_count() > 0
    assert _ffi.executor_available("cuda") is expected
    desc = _ffi.executor_description("cuda")
    if not built:
        assert "built without CUDA" in desc
    elif not expected:
        assert "no CUDA device is visible" in desc


def test_unknown_executor_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be 'cpu' or 'cuda'"):
        _ffi.executor_available("tpu")


def test_gpu_skip_reason_names_what_is_missing():
    why = cuda_missing()
    usable = bool(_core.cuda.built) and driver_device_count() > 0
    assert (why == "") is usable
    if not _core.cuda.built:
        assert "built without CUDA" in why
    elif not usable:
        assert "no CUDA GPU visible" in why
