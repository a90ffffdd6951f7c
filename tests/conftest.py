import os

import pytest


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a CUDA device is usable (tools/gpu/run.py on the GPU machine)."""
    try:
        from tide import _core
        have_gpu = _core.cuda.available()
    except Exception:  # noqa: BLE001 - an unbuilt core also means "no GPU path"
        have_gpu = False
    slow = os.environ.get("TIDE_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of tide._core"))
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow opt-in run: set TIDE_SLOW=1"))
