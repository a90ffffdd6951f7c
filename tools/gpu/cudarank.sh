#!/usr/bin/env bash
# GPU checks of the CUDA rank executor over the CUDA-IPC fabric (issue #4): the multi-process
# tests (tests/test_cuda_ipc.py: world 2 and 4, ranks sharing GPU 0 and, with >= 2 GPUs, spread
# over them; bit-equal to the CPU VirtualCluster; a dead peer is a named timeout), then the
# in-process CUDA executor's tests as a regression check. Assumes tide/_core*.so is built with
# CUDA (tools/gpu_check.sh's build step). Logs go to $OUT (or ./gpu_out); a table is printed LAST.
# PASS: pytest passed and at least one test ran (an all-skipped file is a FAIL: no GPU / no CUDA
# build). With one GPU the two spread-over-GPU cases of test_cuda_ipc.py skip (reason printed).
#
#   bash tools/gpu/cudarank.sh
set -uo pipefail
source "$(dirname "$0")/common.sh"
declare -A R
order=()

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  $PY -c "from tide import _core; print('built_with_cuda', _core.built_with_cuda, 'devices', _core.cuda_device_count()); print(_core.cuda_capabilities(0))"
} >"$OUT/cudarank_diag.log" 2>&1
ngpu=$($PY -c "from tide import _core; print(_core.cuda_device_count())" 2>/dev/null || echo 0)

run() {  # name, timeout_s, log, pytest args...
  local name=$1 limit=$2 log=$3
  shift 3
  order+=("$name")
  local t0=$(date +%s)
  if timeout $limit $PY -m pytest -x -q -rs "$@" >"$OUT/$log" 2>&1; then
    local summary="$(tail -1 "$OUT/$log" | sed 's/=//g' | xargs)"
    if [[ "$summary" == *passed* ]]; then
      R[$name]="PASS ($summary, $(($(date +%s) - t0)) s)"
    else  # everything skipped: no GPU or no CUDA build here
      R[$name]="FAIL (nothing ran: $summary; see $log)"
    fi
  else
    R[$name]="FAIL (rc $?, see $log)"
    tail -40 "$OUT/$log"
  fi
}

run cuda_ipc 240 cudarank_ipc.log -m gpu tests/test_cuda_ipc.py
run cuda_executor_regression 300 cudarank_executor.log -m gpu tests/test_cuda_executor.py
run nogpu_surface 60 cudarank_nogpu.log tests/test_cuda_backend_nogpu.py

echo
echo "== cudarank summary (GPUs visible: $ngpu; spread-over-GPU cases skip with 1)"
printf "%-28s %s\n" item result
for k in "${order[@]}"; do printf "%-28s %s\n" "$k" "${R[$k]}"; done
