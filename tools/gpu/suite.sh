#!/usr/bin/env bash
# Every GPU-marked test of the suite in one pytest (the per-area scripts run subsets with their
# own extras). Assumes tide was built with CUDA (tools/gpu_check.sh's build step).
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 bash tools/gpu/suite.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ "${NCCL_NVLS_ENABLE:-}" != "0" || "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" != "1" ]]; then
  echo "suite.sh: export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 first" >&2
  exit 2
fi
unset TIDE_ENABLE_MULTICAST
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32} XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
$PY -m pytest -m gpu -q -p no:cacheprovider -rs --timeout=240 --timeout-method=thread tests/ ${SUITE_ARGS:-} 2>&1 \
  | tail -${SUITE_TAIL:-40}
rc=${PIPESTATUS[0]}
echo "suite: pytest -m gpu tests/ rc=$rc"
exit "$rc"
