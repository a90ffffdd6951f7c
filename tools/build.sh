#!/usr/bin/env bash
# In-place build of tide._core (and tide_xla._ffi): modules land next to their packages, so
# `python -c "import tide"` works from the repo root. Used by the Makefile, CI and the GPU machine.
# Env: PYTHON (default .venv/bin/python), TIDE_CUDA=auto|on|off, BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
BUILD_DIR=${BUILD_DIR:-build/inplace}
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DTIDE_INPLACE=ON -DTIDE_CUDA="${TIDE_CUDA:-auto}" \
  -DPython_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')" \
  -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" >/dev/null
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
