"""Loads tide_xla._ffi and registers its handlers with XLA, once, before the first lowering."""
from __future__ import annotations

import functools

import jax


@functools.lru_cache(maxsize=None)
def ffi_module():
    """The compiled extension; ImportError explains how to build it."""
    try:
        from tide_xla import _ffi
    except ImportError as e:  # pragma: no cover - depends on the build
        raise ImportError(
            "tide_xla._ffi is not built: run `tools/build.sh` (in place) or `pip install .` "
            f"with jaxlib >= 0.11.2 installed ({e})") from e
    return _ffi


@functools.lru_cache(maxsize=None)
def ensure_registered() -> tuple[str, ...]:
    """Registers every (platform, target) of `_ffi.registrations()`; returns the platforms."""
    ffi = ffi_module()
    platforms = []
    for platform, targets in ffi.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        platforms.append(platform)
    return tuple(platforms)
