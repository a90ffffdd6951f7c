#!/usr/bin/env bash
# The GPU machine's one script: build (CUDA on), GPU tests, compute-sanitizer on a small case,
# the layout bench; prints a short table LAST. Logs and JSON go to $OUT (or ./gpu_out).
#
#   export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
#   bash tools/gpu_check.sh            # GPU_CHECK_SKIP="sanitize bench" skips stages
#
# Safety: refuses to run unless multicast is disabled in the environment (ARCHITECTURE.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
SKIP=${GPU_CHECK_SKIP:-}
PY=${PYTHON:-python3}
if [[ "${NCCL_NVLS_ENABLE:-}" != "0" || "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" != "1" ]]; then
  echo "gpu_check: export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 first" >&2
  exit 2
fi
unset TIDE_ENABLE_MULTICAST
# Many ranks' streams share one GPU: use every hardware queue (the executor's enqueue order is
# deadlock-free for any mapping, see executor.h [Note: enqueue order]; this only cuts false waits).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
declare -A R
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader \
  | tee "$OUT/diag.log"

# ---- 1. build --------------------------------------------------------------------------------
rm -rf build/inplace
if TIDE_CUDA=on PYTHON=$PY CMAKE_BUILD_TYPE=Release tools/build.sh >"$OUT/build.log" 2>&1; then
  R[build]=ok
else
  R[build]=FAILED; tail -40 "$OUT/build.log"
fi
kernels=$(grep -c "Compiling entry function" "$OUT/build.log" || true)
spills=$(grep -E "spill (stores|loads)" "$OUT/build.log" | grep -vc " 0 bytes spill stores, 0 bytes spill loads" || true)
R[ptxas]="$kernels kernels, $spills with spills"
t1=$(date +%s); R[build_s]=$((t1 - t0))

# ---- 2. GPU tests ------------------------------------------------------------------------------
if [[ ${R[build]} == ok ]]; then
  $PY -c "import tide, torch; from tide import _core; print('cuda_available', _core.cuda_available(), torch.__version__)"
  # Plan smoke: does the planner run here (plain / after torch / after CUDA init)? A crash gets
  # a native backtrace from cuda-gdb (the machine has no gdb) in diag.log.
  SMOKE='import tide; p = tide.plan(tide.GroupSignature(shapes=[(37, 16), (5,)]), tide.Topology(1, 1)); print("plan ok", hex(p.hash))'
  for pre in "" "import torch; " "from tide import _core; _core.cuda_available(); import numpy, ml_dtypes, torch; "; do
    echo "== smoke: ${pre}plan" >>"$OUT/diag.log"
    if ! timeout 120 $PY -X faulthandler -c "${pre}${SMOKE}" >>"$OUT/diag.log" 2>&1; then
      R[plan_smoke]="CRASH (${pre:-plain})"
      timeout 180 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt -ex "info registers rip" \
        --args $PY -c "${pre}${SMOKE}" >>"$OUT/diag.log" 2>&1
    fi
  done
  R[plan_smoke]=${R[plan_smoke]:-ok}
  # -n 4: tests run in worker processes, so a native crash fails one test, not the session.
  $PY -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda_*.py -rs --timeout=300 2>&1 | tee "$OUT/tests.log"
  R[tests]=$(tail -1 "$OUT/tests.log")
  t2=$(date +%s); R[tests_s]=$((t2 - t1))

  # ---- 3. compute-sanitizer (small case, no framework) ----------------------------------------
  if [[ " $SKIP " != *" sanitize "* ]] && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      PYTHONPATH=$PWD timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $PY tools/gpu_sanitize_case.py \
        >"$OUT/sanitize_$tool.tmp" 2>&1
      rc=$?
      R[sanitize_$tool]="rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.tmp" | tail -1)"
      cat "$OUT/sanitize_$tool.tmp" >>"$OUT/sanitize.log"; rm -f "$OUT/sanitize_$tool.tmp"
    done
  fi
  t3=$(date +%s); R[sanitize_s]=$((t3 - t2))

  # ---- 4. layout bench ---------------------------------------------------------------------------
  if [[ " $SKIP " != *" bench "* ]]; then
    $PY -m tide.bench.layout --json "$OUT/layout.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    R[bench]=$([[ ${PIPESTATUS[0]} == 0 ]] && echo ok || echo FAILED)
  fi
  t4=$(date +%s); R[bench_s]=$((t4 - t3))
fi

# ---- summary (last) ----------------------------------------------------------------------------
echo
echo "================ gpu_check summary ($(date -u +%FT%TZ)) ================"
for k in build ptxas build_s plan_smoke tests tests_s sanitize_memcheck sanitize_racecheck sanitize_s bench bench_s; do
  [[ -n "${R[$k]:-}" ]] && printf '%-20s %s\n' "$k" "${R[$k]}"
done
[[ -f "$OUT/bench.log" ]] && grep -E "^(#|group|llama|qwen|wan|SUM| +[0-9])" "$OUT/bench.log" | tail -70
grep -E "FAILED|ERROR|crashed" "$OUT/tests.log" | head -20
[[ ${R[build]} == ok ]] || exit 1
