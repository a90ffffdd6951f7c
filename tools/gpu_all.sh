#!/usr/bin/env bash
# One device call: build + the GPU checks of tools/gpu_check.sh, then the per-area GPU scripts
# tools/gpu/<name>.sh named in STAGES, each under its own time limit; a combined summary LAST.
#
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 STAGES="sumk:200 cudarank torchgpu" \
#     bash tools/gpu_all.sh
#
# STAGE_LIMIT_S (default 150) caps each script unless its entry says name:limit_s; GPU_CHECK_SKIP is passed to gpu_check.sh
# (default: everything but build and smoke; the stages run their own tests).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${NCCL_NVLS_ENABLE:-}" != "0" || "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" != "1" ]]; then
  echo "gpu_all: export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 first" >&2
  exit 2
fi
export NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi -L
GPU_CHECK_SKIP=${GPU_CHECK_SKIP:-"kernels bench executor demo sanitize"} bash tools/gpu_check.sh >"$OUT/check.log" 2>&1
rc=$?
sed -n '/gpu_check summary/,$p' "$OUT/check.log" > "$OUT/summary_check.txt"
[[ $rc == 0 ]] || { cat "$OUT/check.log" | tail -60; exit 1; }
declare -A RC DUR
NAMES=()
for spec in ${STAGES:-}; do  # "name" or "name:limit_s"
  s=${spec%%:*}; limit=${STAGE_LIMIT_S:-150}; [[ $spec == *:* ]] && limit=${spec#*:}
  NAMES+=("$s")
  f=tools/gpu/$s.sh
  [[ -f $f ]] || { RC[$s]="missing"; continue; }
  a=$(date +%s)
  mkdir -p "$OUT/$s"
  OUT="$OUT/$s" timeout -k 10 "$limit" bash "$f" >"$OUT/$s.log" 2>&1
  RC[$s]=$?
  DUR[$s]=$(( $(date +%s) - a ))
  # keep the number of files under $OUT small: fold the stage's own files into its log
  for g in "$OUT/$s"/*; do [[ -f $g && $g != *.json && $g != *.png ]] && { echo "== $g"; tail -200 "$g"; } >>"$OUT/$s.log"; done
  find "$OUT/$s" -type f ! -name '*.json' ! -name '*.png' -delete
done
echo
echo "================ gpu_all ($(date -u +%FT%TZ), $(( $(date +%s) - t0 )) s) ================"
cat "$OUT/summary_check.txt"
for s in "${NAMES[@]}"; do
  echo
  echo "---------------- $s: rc=${RC[$s]} (${DUR[$s]:-0} s; 124 = over its limit) ----------------"
  [[ -f "$OUT/$s.log" ]] && tail -${STAGE_TAIL:-25} "$OUT/$s.log"
done
