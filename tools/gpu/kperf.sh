#!/usr/bin/env bash
# Issue #4 kernel rates after the kperf changes (REDUCE dense/generic bodies, SUM 256 x 5, bulk
# proxy fence + ring-geometry rows): runs tools/gpu/sumk.sh (kernel tests under every variant,
# sweep incl. the new `land` entry and `# bulk ring` rows, sanitizers) and judges its sweep JSON.
# Short summary table LAST.
#
#   bash tools/gpu/kperf.sh         # from the repo root; logs go to $OUT (./gpu_out_kperf)
#
# Files in $OUT: sumk_tests.log, sumk_sweep.log, sumk_sweep.json (sumk.sh's) and kperf.log (its
# stdout). Assumes tide/_core*.so is built with CUDA (tools/gpu_check.sh's build step).
# Safety: multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out_kperf}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

OUT="$OUT" bash tools/gpu/sumk.sh >"$OUT/kperf.log" 2>&1
sumk_rc=$?
sed -n '/================ sweep/,$p' "$OUT/kperf.log" | grep -vE "^(sum|reduce|land) " | head -60
echo
echo "---- rows at 256 MiB (vec) ----"
grep -E "^(sum|reduce|land) +vec +vec +67108864 " "$OUT/sumk_sweep.log"

summ() {
  local v; v=$(grep -E "^$1 " "$OUT/kperf.log" | tail -1 | sed "s/^$1 *//")
  echo "${v:-MISSING (not in the sumk.sh summary)}"
}
VERDICTS=$(mktemp)
SWEEP_JSON="$OUT/sumk_sweep.json" $PY - >"$VERDICTS" 2>&1 <<'PYEOF'
import json, os
try:
    d = json.load(open(os.environ["SWEEP_JSON"]))
except Exception as e:  # no sweep (no GPU, crashed): every item FAILs with the reason
    for k in ("no_spills", "bitwise", "sum_vec", "reduce_vec", "land_vec"):
        print(f"{k}|FAIL (no sweep JSON: {e})")
    raise SystemExit(0)
big = max(r["n"] for r in d["rows"])
sms = d["sms"]
def per(entry, variant, c):
    for r in d["rows"]:
        if (r["entry"], r["variant"], r["n"], r["ctas"]) == (entry, variant, big, c):
            return r
    return None
print(f"no_spills|{'PASS' if not d['spilled'] else 'FAIL'} ({len(d['kernel_attrs'])} kernels; "
      f"spilled: {[a['name'] for a in d['spilled']] or 'none'})")
bad = [f"{c['entry']}/{c['variant']}" for c in d["checks"] if not c["bitwise_equal_to_first"]]
print(f"bitwise|{'PASS' if not bad else 'FAIL'} (every variant == the first of its input group; differing: {bad or 'none'})")
def line(entry, need_per, need_full, rel=None):
    rs = [per(entry, "vec", c) for c in (4, 8, 16)]
    full = per(entry, "vec", sms)
    if None in rs or full is None:
        return f"{entry}_vec|FAIL (rows missing)"
    pc = [r["gbps_per_cta"] for r in rs]
    ok = all(x >= need_per for x in pc) and full["pct_ceiling"] >= need_full
    return (f"{entry}_vec|{'PASS' if ok else 'FAIL'} (GB/s per CTA at 4/8/16 = "
            f"{'/'.join(f'{x:.0f}' for x in pc)}, need >= {need_per:.0f}{rel or ''}; full grid "
            f"{full['pct_ceiling']:.1f}%, need >= {need_full:.0f}%)")
print(line("sum", 99, 80))
s8 = per("sum", "vec", 8)
ref = 0.9 * s8["gbps_per_cta"] if s8 else 99
print(line("reduce", ref, 80, " = 0.9 x sum/vec at 8"))
print(line("land", ref, 75, " = 0.9 x sum/vec at 8"))
PYEOF

echo
echo "================ kperf summary ($(date -u +%FT%TZ)) ================"
printf '%-20s %s\n' sumk_rc "$sumk_rc (sumk.sh: 0 when all its steps ran)"
for k in tests_vec tests_bulk tests_vec_l2 sweep sanitize_memcheck sanitize_racecheck sanitize_synccheck; do
  printf '%-20s %s\n' "$k" "$(summ "$k")"
done
while IFS='|' read -r k v; do printf '%-20s %s\n' "$k" "$v"; done <"$VERDICTS"
rm -f "$VERDICTS"
grep -E "^# bulk ring" "$OUT/sumk_sweep.log" | sed 's/^# bulk ring: /bulk_ring (INFO)     /'
