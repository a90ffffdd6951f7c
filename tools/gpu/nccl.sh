#!/usr/bin/env bash
# GPU checks of the NCCL fabric (issue #4, deliverable 2): tests/test_nccl_fabric.py -m gpu --
# world 1 on GPU 0 (arena zeroed; the LSA pointer aliases the ncclMemAlloc pointer, both ways,
# bitwise; rail communicator of size 1; probe agreed; CudaRankExecutor over the fabric at 1 x 1
# runs TIDE-AG and TIDE-RS bit-equal to the CPU VirtualCluster) and, with >= 2 GPUs, world 2 (two
# processes, 1 x 2, AG + RS bitwise; a disagreeing probe field raises the same error on both
# ranks); then the file's CPU tests (loader errors, argument validation) as a regression check.
# Assumes tide/_core*.so is built with CUDA and the NCCL headers (tools/gpu_check.sh's build
# step). Logs go to $OUT (or ./gpu_out); a table is printed LAST.
# PASS: pytest passed and at least one test ran (all-skipped is a FAIL: no GPU, no CUDA build, or
# a build without NCCL headers). With one GPU the two world-2 tests skip ("needs two GPUs").
#
#   bash tools/gpu/nccl.sh
set -uo pipefail
source "$(dirname "$0")/common.sh"  # NCCL_NVLS_ENABLE=0: window registration binds no multicast

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  $PY -c "from tide import _core; print('built_with_cuda', _core.built_with_cuda, 'devices', _core.cuda_device_count(), 'nccl headers', _core.nccl_header_version()); print('nccl', _core.nccl_version(), _core.nccl_library_path())"
} >"$OUT/nccl_diag.log" 2>&1
ngpu=$($PY -c "from tide import _core; print(_core.cuda_device_count())" 2>/dev/null || echo 0)
nccl=$($PY -c "from tide import _core; print(_core.nccl_header_version(), _core.nccl_version())" 2>/dev/null || echo "?")


run_pytest nccl_fabric_gpu 300 nccl_gpu.log -m gpu tests/test_nccl_fabric.py
run_pytest nccl_fabric_cpu 120 nccl_cpu.log -m "not gpu" tests/test_nccl_fabric.py

summary "nccl summary (GPUs visible: $ngpu; NCCL headers/library: $nccl; world-2 tests skip with 1 GPU)"
