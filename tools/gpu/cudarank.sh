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

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  $PY -c "from tide import _core; print('built_with_cuda', _core.built_with_cuda, 'devices', _core.cuda_device_count()); print(_core.cuda_capabilities(0))"
} >"$OUT/cudarank_diag.log" 2>&1
ngpu=$($PY -c "from tide import _core; print(_core.cuda_device_count())" 2>/dev/null || echo 0)

run_pytest cuda_ipc 240 cudarank_ipc.log -x -m gpu tests/test_cuda_ipc.py
run_pytest cuda_executor_regression 300 cudarank_executor.log -x -m gpu tests/test_cuda_executor.py
run_pytest nogpu_surface 60 cudarank_nogpu.log -x tests/test_cuda_backend_nogpu.py

summary "cudarank summary (GPUs visible: $ngpu; spread-over-GPU cases skip with 1)"
