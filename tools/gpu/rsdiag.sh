#!/usr/bin/env bash
# Issue #4: where the 70B RS chain's time above its floor goes (tools/gpu/rsdiag.py); one table.
# Assumes tide was built with CUDA (tools/gpu_check.sh's build step).
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 bash tools/gpu/rsdiag.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
unset TIDE_ENABLE_MULTICAST
PYTHONPATH=. ${PYTHON:-python3} tools/gpu/rsdiag.py
