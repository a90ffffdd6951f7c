#!/usr/bin/env bash
# tide_torch's CUDA path on the GPU machine: the GPU tests (tests/test_torch_gpu.py), then the
# example on one GPU and, when two GPUs are visible, under torchrun over two; a summary table
# LAST (PASS / FAIL / SKIP per item). Assumes tide/_core*.so is already built with CUDA
# (tools/gpu_check.sh's build step). Logs and JSON go to $OUT (or ./gpu_out), 4 files:
#   torchgpu_tests.log, torchgpu_example.log, torchgpu_1gpu.json, torchgpu_2gpu.json
#
#   bash tools/gpu/torchgpu.sh                      # example size: small
#   TORCHGPU_SIZE=1b TORCHGPU_STEPS=10 bash tools/gpu/torchgpu.sh
#   TORCHGPU_EXAMPLE=0 (tests only), TORCHGPU_FABRIC=nccl (the example over the NCCL fabric),
#   TORCHGPU_TESTS="test_a test_b" (a subset of tests/test_torch_gpu.py)
set -uo pipefail
source "$(dirname "$0")/common.sh"
SIZE=${TORCHGPU_SIZE:-small}
STEPS=${TORCHGPU_STEPS:-10}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

declare -A R
ORDER=()
put() { ORDER+=("$1"); R[$1]=$2; }

ngpu=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
caps=$($PY -c "
import tide
from tide_torch import comm
print('CudaRankExecutor=%s CudaIpcFabric=%s cuda_available=%s' % (
    hasattr(tide._core, 'CudaRankExecutor'), hasattr(tide._core, 'CudaIpcFabric'),
    tide._core.cuda_available()))" 2>&1 | tail -1)
echo "torchgpu: $ngpu GPU(s); $caps" | tee "$OUT/torchgpu_tests.log"

# ---- 1. GPU tests, one pytest per test so that one failure or hang does not hide the others ---
for t in ${TORCHGPU_TESTS:-test_world1_cuda test_world1_cuda_nccl_fabric test_world2_one_gpu_ipc \
         test_world2_two_gpus_nccl test_world2_two_gpus_nccl_fabric test_world1_cpu test_world2_cpu \
         test_cuda_transport_calls test_nccl_arena_calls}; do
  echo "==== $t" >>"$OUT/torchgpu_tests.log"
  timeout 900 $PY -m pytest -q -p no:cacheprovider -rs "tests/test_torch_gpu.py::$t" \
    >>"$OUT/torchgpu_tests.log" 2>&1
  rc=$?
  last=$(grep -E "^[=]* ?[0-9]+ (passed|failed|skipped|error)" "$OUT/torchgpu_tests.log" | tail -1 | tr -d '=' | xargs)
  if [[ $rc == 0 && "$last" == *passed* ]]; then
    put "$t" "PASS  $last"
  elif [[ $rc == 0 && "$last" == *skipped* ]]; then
    why=$(grep -E "^SKIPPED" "$OUT/torchgpu_tests.log" | tail -1 | sed 's/.*: //')
    if [[ $ngpu -ge 1 && "$t" != *two_gpus* ]]; then  # on a GPU machine only two-GPU tests may skip
      put "$t" "FAIL  skipped with $ngpu GPU(s): $why"
    else
      put "$t" "SKIP  $why"
    fi
  else
    put "$t" "FAIL  rc=$rc $last"
  fi
done

# ---- 2. the example: stock / TIDE In-Place / TIDE Slot-Reuse ---------------------------------
example() {  # name json launcher...
  local name=$1 json=$2; shift 2
  echo "==== $name: $*" >>"$OUT/torchgpu_example.log"
  timeout 900 "$@" examples/fsdp2_llama.py --device cuda --size "$SIZE" --steps "$STEPS" \
    --fabric "${TORCHGPU_FABRIC:-auto}" --json "$json" >>"$OUT/torchgpu_example.log" 2>&1
  local rc=$?
  if [[ $rc == 0 && -f "$json" ]]; then
    put "$name" "PASS  $($PY - "$json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{d['device']}, world {d['world']}: " + "; ".join(
    f"{r['name']} {r['step_ms']:.2f} ms {r['peak_bytes'] / 2**30:.2f} GiB loss {r['final_loss']:.4f}"
    for r in d["runs"]))
EOF
)"
  else
    put "$name" "FAIL  rc=$rc (see torchgpu_example.log)"
  fi
}
: >"$OUT/torchgpu_example.log"
rm -f "$OUT/torchgpu_1gpu.json" "$OUT/torchgpu_2gpu.json"
if [[ ${TORCHGPU_EXAMPLE:-1} == 0 ]]; then
  put "example_$SIZE" "SKIP  TORCHGPU_EXAMPLE=0"
else
  example "example_1gpu_$SIZE" "$OUT/torchgpu_1gpu.json" $PY
  if [[ $ngpu -ge 2 ]]; then
    example "example_2gpu_$SIZE" "$OUT/torchgpu_2gpu.json" $PY -m torch.distributed.run --nproc-per-node 2
  else
    put "example_2gpu_$SIZE" "SKIP  $ngpu GPU visible"
  fi
fi
grep -E "^(cpu|NVIDIA|stock|tide_|max \||  .*fallbacks)" "$OUT/torchgpu_example.log" | tail -20

# ---- summary (last) -----------------------------------------------------------------------------
echo
echo "================ torchgpu summary ($(date -u +%FT%TZ)) ================"
echo "$caps"
for k in "${ORDER[@]}"; do printf '%-28s %s\n' "$k" "${R[$k]}"; done
for k in "${ORDER[@]}"; do [[ "${R[$k]}" == FAIL* ]] && exit 1; done
exit 0
