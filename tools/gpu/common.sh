# Sourced first by the tools/gpu/<name>.sh stage scripts: the repo root as working directory,
# $OUT (default ./gpu_out), $PY, and the safety environment (ARCHITECTURE.md: multicast stays
# off, nothing here creates a multicast object or changes a GPU setting).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
unset TIDE_ENABLE_MULTICAST
# Several ranks' streams may share one GPU: every hardware queue (never 1, NCCL #2238).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}

# One pytest stage: run_pytest NAME TIMEOUT_S LOG PYTEST_ARGS... records PASS / FAIL in R[NAME]
# (all skipped is a FAIL: no GPU or no CUDA build here); summary TITLE prints the table and
# returns 1 when any stage failed.
declare -A R
order=()
run_pytest() {
  local name=$1 limit=$2 log=$3
  shift 3
  order+=("$name")
  local t0=$(date +%s)
  if timeout "$limit" $PY -m pytest -q -rs "$@" >"$OUT/$log" 2>&1; then
    local summary="$(tail -1 "$OUT/$log" | sed 's/=//g' | xargs)"
    if [[ "$summary" == *passed* ]]; then
      R[$name]="PASS ($summary, $(($(date +%s) - t0)) s)"
    else
      R[$name]="FAIL (nothing ran: $summary; see $log)"
    fi
  else
    R[$name]="FAIL (rc $?, see $log)"
    tail -40 "$OUT/$log"
  fi
}
summary() {
  echo
  echo "== $1"
  printf "%-28s %s\n" item result
  local k rc=0
  for k in "${order[@]}"; do printf "%-28s %s\n" "$k" "${R[$k]}"; done
  for k in "${order[@]}"; do [[ ${R[$k]} == PASS* ]] || rc=1; done
  return $rc
}
