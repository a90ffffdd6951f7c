#!/usr/bin/env bash
# The GPU machine's one script: build (CUDA on), a planner smoke test, GPU tests, the layout
# bench, compute-sanitizer on a small case; prints a short table LAST. Logs/JSON go to $OUT
# (or ./gpu_out), at most 8 files (the device tool's limit).
#
#   export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
#   bash tools/gpu_check.sh            # GPU_CHECK_SKIP="sanitize bench executor" skips stages
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
# [Note: libstdc++ in _core] On 2026-11-29 the module built on the GPU machine carried its own
# (exported) copy of libstdc++ and crashed in the first std::ostringstream number insertion
# (tide::validate_inputs -> ostream::_M_insert<long>), a two-copies-of-libstdc++ locale mix-up;
# the local build links libstdc++.so. Build with a clean flag environment and hide every static
# archive's symbols (-Wl,--exclude-libs,ALL) so any static copy stays self-consistent.
{
  echo "== toolchain"; c++ --version | head -1; cmake --version | head -1; nvcc --version | tail -1
  echo "libstdc++.so: $(c++ -print-file-name=libstdc++.so)  libstdc++.a: $(c++ -print-file-name=libstdc++.a)"
  env | grep -E '^(CC|CXX|CUDACXX|LDFLAGS|CFLAGS|CXXFLAGS|CPPFLAGS|CUDAFLAGS|LIBRARY_PATH)=' || true
} >>"$OUT/diag.log" 2>&1
rm -rf build/inplace
# A runtime image may lack the libstdc++.so dev symlink: then -lstdc++ silently takes libstdc++.a
# and the module carries a second libstdc++ (the crash above). Point the linker at the shared one.
LINK_FLAGS="-Wl,--exclude-libs,ALL"
if [[ "$(c++ -print-file-name=libstdc++.so)" != /* ]]; then
  so6=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/{print $NF; exit}')
  if [[ -n "$so6" ]]; then
    mkdir -p build/linkfix && ln -sf "$so6" build/linkfix/libstdc++.so
    LINK_FLAGS="$LINK_FLAGS -L$PWD/build/linkfix"
    echo "libstdc++.so dev symlink missing: linking $so6" >>"$OUT/diag.log"
  fi
fi
if env -u CFLAGS -u CXXFLAGS -u CPPFLAGS -u CUDAFLAGS LDFLAGS="$LINK_FLAGS" \
    TIDE_CUDA=on PYTHON=$PY CMAKE_BUILD_TYPE=Release tools/build.sh >"$OUT/build.log" 2>&1; then
  R[build]=ok
else
  R[build]=FAILED; tail -40 "$OUT/build.log"
fi
kernels=$(grep -c "Compiling entry function" "$OUT/build.log" || true)
spills=$(grep -E "spill (stores|loads)" "$OUT/build.log" | grep -vc " 0 bytes spill stores, 0 bytes spill loads" || true)
R[ptxas]="$kernels kernels, $spills with spills"
so=$(ls tide/_core*.so 2>/dev/null | head -1)
if [[ -n "$so" ]]; then
  R[libstdcxx_in_core]="$(nm -D --defined-only "$so" 2>/dev/null | c++filt | grep -c ' std::') exported std:: symbols"
  { echo "== ldd $so"; ldd "$so"; echo "== _M_insert<long> in _core"; nm -DC "$so" | grep "_M_insert<long>"; } \
    >>"$OUT/diag.log" 2>&1
fi
t1=$(date +%s); R[build_s]=$((t1 - t0))

if [[ ${R[build]} == ok ]]; then
  # ---- 2. planner smoke (a crash gets a native backtrace from cuda-gdb: there is no gdb) -------
  SMOKE='import tide; p = tide.plan(tide.GroupSignature(shapes=[(37, 16), (5,)]), tide.Topology(1, 1)); print("plan ok", hex(p.hash))'
  pre="from tide import _core; _core.cuda_available(); import numpy, ml_dtypes, torch; "
  echo "== smoke" >>"$OUT/diag.log"
  if timeout 120 $PY -X faulthandler -c "${pre}${SMOKE}" >>"$OUT/diag.log" 2>&1; then
    R[plan_smoke]=ok
  else
    R[plan_smoke]=CRASH
    timeout 120 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt \
      --args $PY -c "${pre}${SMOKE}" 2>&1 | grep -v "New Thread\|exited\]" >>"$OUT/diag.log"
  fi

  # ---- 3. kernel tests --------------------------------------------------------------------------
  if [[ " $SKIP " != *" kernels "* ]]; then
    timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -rs --timeout=90 --timeout-method=thread 2>&1 \
      | tee "$OUT/tests.log"
    R[tests_kernels]=$(tail -1 "$OUT/tests.log")
  fi

  # ---- 4. layout bench ---------------------------------------------------------------------------
  t2=$(date +%s)
  if [[ " $SKIP " != *" bench "* ]]; then
    timeout 200 $PY -m tide.bench.layout --json "$OUT/layout.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    R[bench]=$([[ ${PIPESTATUS[0]} == 0 ]] && echo ok || echo FAILED)
  fi
  t3=$(date +%s); R[bench_s]=$((t3 - t2))

  # ---- 5. executor tests (bitwise vs the CPU executor, faults); need the planner -------------------
  if [[ " $SKIP " != *" executor "* && ${R[plan_smoke]} == ok ]]; then
    timeout 240 $PY -m pytest -q -p no:cacheprovider -x tests/test_cuda_executor.py -rs --timeout=90 --timeout-method=thread 2>&1 \
      | tee -a "$OUT/tests.log"
    R[tests_executor]=$(tail -1 "$OUT/tests.log")
  else
    R[tests_executor]="not run (plan smoke: ${R[plan_smoke]})"
  fi
  t4=$(date +%s); R[tests_s]=$((t4 - t3))

  # ---- 5b. the main job on the GPU (README's first command picks the CUDA backend here) -----------
  if [[ " $SKIP " != *" demo "* && ${R[plan_smoke]} == ok ]]; then
    timeout 120 $PY -m tide demo >"$OUT/demo.log" 2>&1
    R[demo]="rc=$? $(grep -E 'Agreement check' "$OUT/demo.log" | tr -d '=' | xargs)"
    head -4 "$OUT/demo.log"
  fi

  # ---- 6. compute-sanitizer (small case, no framework) ------------------------------------------
  if [[ " $SKIP " != *" sanitize "* ]] && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      PYTHONPATH=$PWD timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $PY tools/gpu_sanitize_case.py \
        >"$OUT/sanitize_$tool.tmp" 2>&1
      rc=$?
      R[sanitize_$tool]="rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.tmp" | tail -1)"
      cat "$OUT/sanitize_$tool.tmp" >>"$OUT/sanitize.log"; rm -f "$OUT/sanitize_$tool.tmp"
    done
  fi
fi

# ---- summary (last) ----------------------------------------------------------------------------
echo
echo "================ gpu_check summary ($(date -u +%FT%TZ)) ================"
for k in build ptxas libstdcxx_in_core build_s plan_smoke tests_kernels bench bench_s tests_executor tests_s demo \
         sanitize_memcheck sanitize_racecheck; do
  [[ -n "${R[$k]:-}" ]] && printf '%-20s %s\n' "$k" "${R[$k]}"
done
[[ -f "$OUT/bench.log" ]] && grep -E "^(#|group|llama|qwen|wan|SUM| +[0-9])" "$OUT/bench.log" | tail -70
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" 2>/dev/null | head -20
[[ ${R[build]} == ok ]] || exit 1
