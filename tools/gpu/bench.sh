#!/usr/bin/env bash
# Issue 7/8 benchmark suite on the GPU machine: `tide bench ag`, `rs`, `interference`, `layout`,
# `train` at real sizes (and `ag --ce-proof`), JSON + PNG to $OUT/bench, summary table LAST.
#
#   export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
#   bash tools/gpu/bench.sh          # BENCH_SKIP="train layout" skips stages; BENCH_PNG=0: no PNGs;
#                                    # BENCH_TOPOLOGIES=1x8,2x4,4x2,8x1: TIDE rows on those node splits;
#                                    # BENCH_NCCL_CTAS=default,8,4: NCCL interference rows per CTA limit
#
# Assumes tide/_core*.so was built with CUDA (tools/gpu_check.sh's build step); builds nothing.
# Files back: $OUT/bench/{bench.json, bench.log, ag.png, rs.png, interference.png, train.png,
# ceproof.png} (7; BENCH_PNG=0 leaves 2). Expected on one H200 (each stage has a hard timeout):
#   ag ~45 s (32 + 128 MiB shards, N = 8 virtual ranks, 10 reps), rs ~45 s, interference ~60 s,
#   layout ~60 s, train ~120 s (torch on 1 GPU, jax on XLA:CPU), ce-proof ~15 s: ~6 min in all.
# Safety: exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (refuses if either is set
# otherwise), unsets TIDE_ENABLE_MULTICAST; changes no GPU settings.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
B="$OUT/bench"
mkdir -p "$B"
T=$(mktemp -d)
PY=${PYTHON:-python3}
SKIP=${BENCH_SKIP:-}
PNG=${BENCH_PNG:-1}
if [[ "${NCCL_NVLS_ENABLE:-0}" != "0" || "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" != "1" ]]; then
  echo "bench.sh: refusing: multicast must stay off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1)" >&2
  exit 2
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
unset TIDE_ENABLE_MULTICAST
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
LOG="$B/bench.log"
: >"$LOG"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
echo "== $(date -u +%FT%TZ) $NGPU GPU(s); commit $(git rev-parse --short HEAD 2>/dev/null)" | tee -a "$LOG"
declare -A R S
ORDER=()

plot() { [[ "$PNG" == 1 ]] && echo "--plot $B/$1.png"; }

stage() {  # stage NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2; shift 2
  ORDER+=("$name")
  if [[ " $SKIP " == *" $name "* ]]; then R[$name]=SKIP; S[$name]=0; return; fi
  local t0=$(date +%s)
  echo "== $name: tide bench $* (timeout ${limit}s)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" $PY -m tide bench "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  S[$name]=$(( $(date +%s) - t0 ))
  if [[ $rc == 0 ]]; then R[$name]=ok; elif [[ $rc == 124 || $rc == 137 ]]; then R[$name]="TIMEOUT"; else R[$name]="rc=$rc"; fi
}

# Hard limits: one GPU / >= 2 GPUs (spawned NCCL ranks start in ~15 s each time).
lim() { if (( NGPU >= 2 )); then echo "$2"; else echo "$1"; fi; }
TOPO=${BENCH_TOPOLOGIES:+--topologies $BENCH_TOPOLOGIES}  # e.g. 1x8,2x4,4x2,8x1 (issue #9)
stage ag "$(lim 100 160)" ag --reps 10 --warmup 2 $TOPO --json "$T/ag.json" $(plot ag)
stage rs "$(lim 100 160)" rs --reps 10 --warmup 2 $TOPO --json "$T/rs.json" $(plot rs)
stage interference "$(lim 130 200)" interference --reps 20 --nccl-ctas "${BENCH_NCCL_CTAS:-default}" --json "$T/interference.json" $(plot interference)
stage layout 200 layout --json "$T/layout.json" $(plot layout)
stage train 220 train --timeout 100 --torch-args "--steps 5" --jax-args "--steps 8" --json "$T/train.json" $(plot train)
# 2 GPUs: the proof (PASS = TIDE-AG's rows reached GPU 1 under the spinner); 1 GPU: labelled INFO run.
stage ce_proof 90 ag --ce-proof --spin-s 2 --sizes 8 --json "$T/ceproof.json" $(plot ceproof)

# ---- merge JSON, judge each stage, summary LAST ----------------------------------------------
$PY - "$T" "$B/bench.json" "$NGPU" "${ORDER[@]}" <<'PYEOF' >"$T/verdicts.txt" 2>>"$LOG"
import json, os, sys
tdir, out, ngpu, names = sys.argv[1], sys.argv[2], int(sys.argv[3] or 0), sys.argv[4:]
files = {"ag": "ag", "rs": "rs", "interference": "interference", "layout": "layout", "train": "train",
         "ce_proof": "ceproof"}
merged, lines = {}, []
for n in names:
    p = os.path.join(tdir, files[n] + ".json")
    if not os.path.exists(p):
        print(f"{n}\tFAIL\tno JSON written")
        continue
    d = json.load(open(p))
    merged[n] = d
    why, ok = [], True
    if n in ("ag", "rs"):
        tide_rows = [r for r in d["rows"] if r["path"].startswith("TIDE") and "med_ms" in r]
        bad = [r["path"] for r in tide_rows if not (r.get("check") == "bitwise" or r.get("rel_err", 1) < 1e-2)]
        ok = bool(tide_rows) and not bad
        why.append(f"{len(tide_rows)} TIDE rows, checks {'ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
        for t in d["targets"]:
            lines.append(f"target\t{n} {t['shard_mib']:g} MiB\t{t['target']}: {t['value']:.2f}x "
                         f"({'met' if t['met'] else 'NOT met'})")
    elif n == "interference":
        ok = all("alone_ms" in r for r in d["rows"] if not r.get("note"))
        t = d.get("target")
        if t:
            lines.append(f"target\tinterference\t{t['target']}: {t['value']:+.1f}% "
                         f"({'met' if t['met'] else 'NOT met'}); beside: "
                         + ", ".join(f"{k} {x:+.1f}%" for k, x in t["stock_beside"].items()))
    elif n == "train":
        notes = [r["note"] for r in d["rows"] if r.get("note")]
        ok = not notes
        why.append("; ".join(notes)[:160] if notes else f"{len(d['rows'])} runs")
    elif n == "ce_proof":
        ok = d.get("verdict") != "FAIL"
        t = d["rows"][0]
        why.append(f"{d.get('label')}: rank 0 rows at GPU 1 after {t.get('arrival_s')} s, spinner ended "
                   f"{t.get('spinner_end_s')} s")
        if d.get("verdict") == "INFO":
            print(f"{n}\tINFO\t{' '.join(why)}")
            continue
    print(f"{n}\t{'PASS' if ok else 'FAIL'}\t{' '.join(why)}")
json.dump(merged, open(out, "w"), indent=1, default=str)
for l in lines:
    print(l)
PYEOF
rm -f "$T"/*.json
echo
echo "==================== tide bench summary ($NGPU GPU(s)) ===================="
printf "%-14s %-8s %-8s %s\n" stage run verdict detail
for n in "${ORDER[@]}"; do
  v=$(awk -F'\t' -v n="$n" '$1 == n {print $2 "\t" $3}' "$T/verdicts.txt")
  verdict=${v%%$'\t'*}; detail=${v#*$'\t'}
  [[ ${R[$n]} == SKIP ]] && verdict=SKIP && detail=""
  [[ ${R[$n]} != ok && ${R[$n]} != SKIP ]] && verdict=FAIL
  printf "%-14s %-8s %-8s %s\n" "$n" "${R[$n]} ${S[$n]}s" "${verdict:-FAIL}" "$detail"
done
awk -F'\t' '$1 == "target" {printf "  %-22s %s\n", $2, $3}' "$T/verdicts.txt"
rm -rf "$T"
