#!/usr/bin/env bash
# In-place build of tide._core (and tide_xla._ffi): modules land next to their packages, so
# `python -c "import tide"` works from the repo root. Used by the Makefile, CI and the GPU machine
# (tools/gpu/run.py's build stage).
# Env: PYTHON (default .venv/bin/python), TIDE_CUDA=auto|on|off, BUILD_DIR, JOBS, CMAKE_BUILD_TYPE,
# BUILD_LOG (default build/build.log).
#
# The compiler's whole output (nvcc runs ptxas -v: registers and spills of every kernel, hundreds
# of lines) goes to BUILD_LOG; the terminal gets one summary line, or on failure the log's last 40
# lines and a non-zero exit. VERBOSE=1 (or `tools/build.sh -v`) prints the build output as well.
set -euo pipefail
cd "$(dirname "$0")/.."
VERBOSE=${VERBOSE:-0}
[[ ${1:-} == -v ]] && VERBOSE=1
PYTHON=${PYTHON:-.venv/bin/python}
BUILD_DIR=${BUILD_DIR:-build/inplace}
BUILD_LOG=${BUILD_LOG:-build/build.log}
mkdir -p "$(dirname "$BUILD_LOG")"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)

PYEXE=$("$PYTHON" -c 'import sys; print(sys.executable)')

phase=configure
if cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DTIDE_INPLACE=ON -DTIDE_CUDA="${TIDE_CUDA:-auto}" -DPython_EXECUTABLE="$PYEXE" \
    -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" >"$BUILD_LOG" 2>&1; then
  phase=build
  if [[ $VERBOSE == 1 ]]; then
    cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" 2>&1 | tee -a "$BUILD_LOG" && rc=0 || rc=${PIPESTATUS[0]}
  else
    cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" >>"$BUILD_LOG" 2>&1 && rc=0 || rc=$?
  fi
else
  rc=$?
fi
if [[ $rc != 0 ]]; then
  [[ $VERBOSE == 1 && $phase == build ]] || tail -40 "$BUILD_LOG"
  echo "tools/build.sh: $phase FAILED (rc $rc) -- full log: $BUILD_LOG" >&2
  exit "$rc"
fi

# One line: what was built, how many build steps, CUDA or not, ptxas' kernel and spill counts.
mods=tide._core
compgen -G "tide_xla/_ffi*.so" >/dev/null && mods="$mods, tide_xla._ffi"
what=()
steps=$(grep -oE '^\[[0-9]+/[0-9]+\]' "$BUILD_LOG" | tail -1 | tr -d '[]' | cut -d/ -f2 || true)
if grep -q "no work to do" "$BUILD_LOG"; then what+=("up to date")
elif [[ -n $steps ]]; then what+=("$steps steps"); fi
if grep -q "TIDE: CUDA executor ON" "$BUILD_LOG"; then
  what+=("CUDA on")
  grep -q "TIDE: NCCL fabric ON" "$BUILD_LOG" && what+=("NCCL fabric on") || what+=("NCCL fabric off")
else
  what+=("CUDA off")
fi
kernels=$(grep -c "Compiling entry function" "$BUILD_LOG" || true)
if (( kernels > 0 )); then
  spills=$(grep -E "bytes spill stores" "$BUILD_LOG" | grep -vc " 0 bytes spill stores, 0 bytes spill loads" || true)
  what+=("$kernels kernels, $spills spills")
fi
summary=${what[0]}
for w in "${what[@]:1}"; do summary="$summary, $w"; done
echo "$mods built ($summary) -- full log: $BUILD_LOG"
