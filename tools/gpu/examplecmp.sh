#!/usr/bin/env bash
# examples/fsdp2_llama.py on one GPU under several executor settings, side by side (stock FSDP2
# is re-measured in every run): EXAMPLECMP_VARIANTS (default below) is a list of
# "name:ENV=VAL,ENV=VAL:fabric"; EXAMPLECMP_SIZE (small), EXAMPLECMP_STEPS (10). Table LAST.
set -uo pipefail
source "$(dirname "$0")/common.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SIZE=${EXAMPLECMP_SIZE:-small}
STEPS=${EXAMPLECMP_STEPS:-10}
VARIANTS=${EXAMPLECMP_VARIANTS:-"ipc::ipc nccl::nccl ipc_lanes1:TIDE_COPY_LANES=1:ipc ipc_2d_per_copy:TIDE_COPY_2D=per_copy:ipc"}
rows=()
for v in $VARIANTS; do
  name=${v%%:*}; rest=${v#*:}; envs=${rest%%:*}; fabric=${rest#*:}
  json="$OUT/ex_$name.json"
  echo "==== $name: env [$envs] fabric $fabric" >>"$OUT/examplecmp.log"
  env ${envs//,/ } timeout 300 $PY examples/fsdp2_llama.py --device cuda --size "$SIZE" --steps "$STEPS" \
    --fabric "$fabric" --json "$json" >>"$OUT/examplecmp.log" 2>&1
  rc=$?
  if [[ $rc == 0 && -f $json ]]; then
    rows+=("$name: $($PY - "$json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
print("; ".join(f"{r['name']} {r['step_ms']:.2f} ms {r['peak_bytes'] / 2**30:.2f} GiB" for r in d["runs"]))
PYEOF
)")
  else
    rows+=("$name: FAIL rc=$rc"); tail -30 "$OUT/examplecmp.log"
  fi
  rm -f "$json"
done
echo
echo "== examplecmp ($SIZE, $STEPS steps)"
printf '%s\n' "${rows[@]}"
