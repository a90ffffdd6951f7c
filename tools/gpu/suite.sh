#!/usr/bin/env bash
# Every GPU-marked test of the suite in one pytest (the per-area scripts run subsets with their
# own extras). Assumes tide was built with CUDA (tools/gpu_check.sh's build step).
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 bash tools/gpu/suite.sh
# SUITE_K="reduce or cuda_executor" selects tests (one pytest -k expression, spaces allowed);
# SUITE_ARGS adds plain pytest arguments (split on spaces).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ "${NCCL_NVLS_ENABLE:-}" != "0" || "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" != "1" ]]; then
  echo "suite.sh: export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 first" >&2
  exit 2
fi
unset TIDE_ENABLE_MULTICAST
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32} XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
# Every test's name and outcome go to $OUT/suite_full.log as they finish, so a run cut by the
# stage's time limit still shows where it was.
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
K=()
[[ -n ${SUITE_K:-} ]] && K=(-k "$SUITE_K")
$PY -m pytest -m gpu -v -p no:cacheprovider -rs --durations=12 --timeout=240 --timeout-method=thread tests/ \
  "${K[@]}" ${SUITE_ARGS:-} >"$OUT/suite_full.log" 2>&1
rc=$?
grep -vE " PASSED( |$)" "$OUT/suite_full.log" | tail -${SUITE_TAIL:-40}
echo "suite: pytest -m gpu tests/ rc=$rc"
exit "$rc"
