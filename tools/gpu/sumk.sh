#!/usr/bin/env bash
# Issue #4 SUM kernel on the GPU machine: the kernel tests under every TIDE_SUM_KERNEL variant
# (vec, vec_l2, bulk), the executor tests with the bulk variant, compute-sanitizer on a small
# bulk case, then the SUM sweep (variants x CTAs, targets). Short summary table LAST.
#
#   bash tools/gpu/sumk.sh          # from the repo root; logs and JSON go to $OUT (./gpu_out_sumk)
#
# Files in $OUT (three; the device tool brings back at most 8): sumk_tests.log (every pytest and
# sanitizer log, in order), sumk_sweep.log (the sweep's table) and sumk_sweep.json.
#
# Assumes tide/_core*.so is already built with CUDA (tools/gpu_check.sh's build step); does not
# rebuild. Safety: multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out_sumk}
mkdir -p "$OUT"
TMPD=$(mktemp -d)
TESTS_LOG="$OUT/sumk_tests.log"
SWEEP_LOG="$OUT/sumk_sweep.log"
: >"$TESTS_LOG"
keep() { { echo "==================== $1"; cat "$2"; } >>"$TESTS_LOG"; }  # step log -> sumk_tests.log
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
unset TIDE_ENABLE_MULTICAST TIDE_SUM_KERNEL
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
PY=${PYTHON:-python3}
declare -A R
KEYS=()
put() { KEYS+=("$1"); R[$1]=$2; }
# PASS only when pytest exited 0 and something ran (all skipped -> FAIL: no GPU or no CUDA build).
verdict() {
  local last; last=$(tail -n 1 "$2")
  if [[ $1 == 0 && $last == *passed* ]]; then echo "PASS ($last)"; else echo "FAIL rc=$1 ($last)"; fi
}
t0=$(date +%s)
BUDGET_S=${SUMK_BUDGET_S:-560}  # the device tool allows 600 s per command: later steps skip past this

# ---- 0. the built module has the variant knob -----------------------------------------------------
if $PY -c "from tide import _core as c; assert c.cuda_available(); print('ran by default:', c.cuda_sum_kernel())" \
    >"$TMPD/module.log" 2>&1; then
  put module "PASS ($(tail -1 "$TMPD/module.log"))"
else
  put module "FAIL (tide._core without cuda_sum_kernel or no GPU: rebuild with TIDE_CUDA=on; $(tail -1 "$TMPD/module.log"))"
fi
keep module "$TMPD/module.log"

# ---- 1. kernel tests, one pytest run per variant (the tests set TIDE_SUM_KERNEL themselves) -------
for sel in "vec:not vec_l2 and not bulk" "bulk:bulk" "vec_l2:vec_l2"; do
  name=${sel%%:*}
  timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "${sel#*:}" -rs \
    --timeout=100 --timeout-method=thread >"$TMPD/tests_$name.log" 2>&1
  put "tests_$name" "$(verdict $? "$TMPD/tests_$name.log")"
  keep "tests_$name" "$TMPD/tests_$name.log"
done
# A hung bulk kernel (a ring/barrier bug) would hang every later bulk launch too: leave it out.
VARIANTS=vec,vec_l2,bulk
if grep -qiE "Timeout|timed out" "$TMPD/tests_bulk.log"; then
  VARIANTS=vec,vec_l2
  BULK_HUNG=1
fi

# ---- 2. the sweep: variants x CTAs, L = 8, 256 MiB of fp32 output and 8 MiB ------------------------
timeout 240 $PY -m tide.bench.sum_sweep --variants "$VARIANTS" --json "$OUT/sumk_sweep.json" >"$SWEEP_LOG" 2>&1
rc=$?
put sweep "$([[ $rc == 0 ]] && echo PASS || echo "FAIL rc=$rc") (PASS = ran, $VARIANTS bitwise equal, no spills)"
put spills "$(grep -E '^# kernels:' "$SWEEP_LOG" | sed 's/^# //')"

# ---- 3. executor tests (AG/RS bitwise vs the CPU executor) with the bulk variant -------------------
if [[ -n ${BULK_HUNG:-} ]] || (( $(date +%s) - t0 > BUDGET_S - 240 )); then
  put executor_bulk "SKIP ($([[ -n ${BULK_HUNG:-} ]] && echo 'bulk kernel tests hung' || echo 'time budget'))"
else
TIDE_SUM_KERNEL=bulk timeout 240 $PY -m pytest -q -p no:cacheprovider -x tests/test_cuda_executor.py -rs \
  --timeout=120 --timeout-method=thread >"$TMPD/tests_executor_bulk.log" 2>&1
put executor_bulk "$(verdict $? "$TMPD/tests_executor_bulk.log")"
keep executor_bulk "$TMPD/tests_executor_bulk.log"
fi

# ---- 4. compute-sanitizer: bulk vs vec, SUM and REDUCE, ring wrapping, misaligned pieces ----------
cat >"$TMPD/sumk_case.py" <<'PYEOF'
import os, struct, sys
from tide import _core as c
n = 40_003
rnd = lambda k: os.urandom(k)
staged = [c.cuda_malloc(2 * n) for _ in range(7)]
own = c.cuda_malloc(2 * (n + 8))
for p in staged: c.cuda_h2d(p, rnd(2 * n))
c.cuda_h2d(own, rnd(2 * (n + 8)))
seg = c.cuda_malloc(32 * 3)
c.cuda_h2d(seg, b"".join(struct.pack("<qqqq", *r) for r in [(0, 30000, 0, 0), (30000, 5, 0, 0xFFFFFFFF), (30005, n - 30005, 3, 0)]))
runs = c.cuda_malloc(144 * 2)
rec = lambda d0, ln, off: struct.pack("<14q16h", d0, ln, *([off] * 8), *([0] * 4), *range(8), *([-1] * 4), 0, 0, 0, 0)
c.cuda_h2d(runs, rec(0, 30000, 0) + rec(30000, n - 30000, 2))
bases = staged + [own]
dst = c.cuda_malloc(4 * n)
out = {}
for v in ("vec", "bulk"):
    os.environ["TIDE_SUM_KERNEL"] = v
    c.cuda_memset(dst, 0xFF, 4 * n, 0)
    c.cuda_sum(dst, n, staged, seg, 3, [own], 2, 0)
    c.cuda_synchronize()
    out["sum", v] = c.cuda_d2h(dst, 4 * n)
    for land, acc in ((False, False), (True, True)):
        c.cuda_h2d(dst, struct.pack(f"{n}f", *[float(i % 7) for i in range(n)]))
        c.cuda_reduce(dst, n, runs, 2, 8, 0, land, acc, 0.25, bases, 2, 0)
        c.cuda_synchronize()
        out["reduce", land, v] = c.cuda_d2h(dst, 4 * n)
bad = [k for k in out if k[-1] == "bulk" and out[k] != out[k[:-1] + ("vec",)]]
print("bulk != vec:", bad if bad else "none")
for p in bases + [seg, runs, dst]: c.cuda_free(p)
sys.exit(1 if bad else 0)
PYEOF
if [[ -n ${BULK_HUNG:-} ]]; then
  put sanitize "SKIP (bulk kernel tests hung)"
elif command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck synccheck; do
    if (( $(date +%s) - t0 > BUDGET_S - 90 )); then put "sanitize_$tool" "SKIP (time budget)"; continue; fi
    PYTHONPATH=$PWD timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $PY "$TMPD/sumk_case.py" \
      >"$TMPD/sanitize_$tool.log" 2>&1
    rc=$?
    summ=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|bulk != vec" "$TMPD/sanitize_$tool.log" | tr '\n' ' ')
    put "sanitize_$tool" "$([[ $rc == 0 ]] && echo PASS || echo "FAIL rc=$rc") ($summ)"
    keep "sanitize_$tool" "$TMPD/sanitize_$tool.log"
  done
else
  PYTHONPATH=$PWD timeout 120 $PY "$TMPD/sumk_case.py" >"$TMPD/sanitize_none.log" 2>&1
  put sanitize "SKIP (no compute-sanitizer); plain run rc=$? $(tail -1 "$TMPD/sanitize_none.log")"
  keep sanitize_none "$TMPD/sanitize_none.log"
fi

# ---- summary (last) ----------------------------------------------------------------------------------
put wall_s "$(($(date +%s) - t0))"
echo "================ sweep, 256 MiB output (all sizes: $SWEEP_LOG) ================"
grep -E "^# .*ceiling|^# kernels|^#   |^entry" "$SWEEP_LOG"
grep -E "^(sum|reduce|land) .* 67108864 " "$SWEEP_LOG" | head -80
grep -E "^# (bulk ring|bitwise|target|variants)" "$SWEEP_LOG"
grep -E "^(FAILED|ERROR)" "$TESTS_LOG" 2>/dev/null | head -20
echo
echo "================ sumk summary ($(date -u +%FT%TZ)) ================"
for k in "${KEYS[@]}"; do printf '%-20s %s\n' "$k" "${R[$k]}"; done
grep -E "^# variants meeting" "$SWEEP_LOG" | sed 's/^# /targets             /'
rm -rf "$TMPD"
