#!/usr/bin/env bash
# tide_torch over the NCCL fabric (enable(fabric="nccl")) on the GPU machine: the GPU tests of
# tests/test_torch_gpu.py for it, the CUDA-IPC tests as a regression check of the shared
# arena code (world 1, and world 2 on one GPU: handles still exchanged and opened), and the CPU
# checks of the same flow; a summary table LAST (PASS / FAIL / SKIP).
# Assumes tide/_core*.so is already built with CUDA and NCCL headers (tools/gpu_check.sh's build
# step). Log: $OUT/torchnccl_tests.log (OUT defaults to ./gpu_out).
#
#   bash tools/gpu/torchnccl.sh          # ~4 min on one H200; give it 600 s
#   TORCHNCCL_EXAMPLE=1 bash tools/gpu/torchnccl.sh   # + examples/fsdp2_llama.py --fabric nccl
#
# PASS per item: pytest exited 0 with the test passed. test_world1_cuda_nccl_fabric: 5 AdamW steps
# of the tiny Llama at world 1 on cuda:0 with the arena in an NcclFabric, both modes, bitwise
# equal to stock FSDP2, every unsharded parameter at its planned landing address, no copy-in /
# copy-out op in the profiler, groups served by tide-cuda-executor, the fabric closed by disable().
# test_world2_two_gpus_nccl_fabric: the same bitwise claims at world 2 on two GPUs (SKIP "needs 2
# GPUs" on one). On a machine with a GPU, any other test that skips is a FAIL.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG=$OUT/torchnccl_tests.log
# Per test (timeout signals the test's whole process group: its spawned ranks too). World 1 took
# well under a minute on the H200 over the CUDA-IPC fabric (BENCHMARKS.md Run 10).
PER_TEST_S=${TORCHNCCL_TIMEOUT:-240}
# Safety (ARCHITECTURE.md): no multicast anywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
unset TIDE_ENABLE_MULTICAST TIDE_TORCH_FABRIC
# Two ranks' streams share one GPU in test_world2_one_gpu_ipc: every hardware queue (as torchgpu.sh).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

declare -A R
ORDER=()
put() { ORDER+=("$1"); R[$1]=$2; }

ngpu=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
caps=$($PY -c "
import torch, tide
from tide_torch.arena import nccl_fabric_api_error
why = nccl_fabric_api_error()
nccl = 'NCCL %d (headers %d)' % (tide._core.nccl_version(), tide._core.nccl_header_version()) if why is None else why
print('%d GPU(s); %s' % (torch.cuda.device_count(), nccl))" 2>&1 | tail -1)
echo "torchnccl: $caps" | tee "$LOG"

# One pytest per test so that one failure or hang does not hide the others.
TESTS=${TORCHNCCL_TESTS:-"test_torch_gpu.py::test_world1_cuda_nccl_fabric
  test_torch_gpu.py::test_world2_two_gpus_nccl_fabric test_torch_gpu.py::test_world1_cuda
  test_torch_gpu.py::test_world2_one_gpu_ipc
  test_torch_gpu.py::test_nccl_arena_calls test_torch_errors.py::test_nccl_fabric_flow_recorded"}
for t in $TESTS; do
  echo "==== $t" >>"$LOG"
  start=$(wc -l <"$LOG")
  timeout -k 10 "$PER_TEST_S" $PY -m pytest -q -p no:cacheprovider -rs "tests/$t" >>"$LOG" 2>&1
  rc=$?
  mine=$(tail -n +"$((start + 1))" "$LOG")
  last=$(grep -E "^[=]* ?[0-9]+ (passed|failed|skipped|error)" <<<"$mine" | tail -1 | tr -d '=' | xargs)
  if [[ $rc == 0 && "$last" == *passed* ]]; then
    put "${t#*::}" "PASS  $last"
  elif [[ $rc == 0 && "$last" == *skipped* ]]; then
    why=$(grep -E "^SKIPPED" <<<"$mine" | tail -1 | sed 's/.*: //')
    if [[ $ngpu -ge 1 && "$t" != *two_gpus* ]]; then  # only the two-GPU test may skip here
      put "${t#*::}" "FAIL  skipped with $ngpu GPU(s): $why"
    else
      put "${t#*::}" "SKIP  $why"
    fi
  else
    put "${t#*::}" "FAIL  rc=$rc $last"
  fi
done

# Opt-in (TORCHNCCL_EXAMPLE=1): the example on one GPU over the NCCL fabric (stock / In-Place /
# Slot-Reuse step times, to set beside torchgpu.sh's CUDA-IPC numbers).
if [[ ${TORCHNCCL_EXAMPLE:-0} == 1 ]]; then
  json=$OUT/torchnccl_example.json
  rm -f "$json"
  echo "==== example --fabric nccl" >>"$LOG"
  timeout -k 10 "$PER_TEST_S" $PY examples/fsdp2_llama.py --device cuda --size small --steps 10 \
    --fabric nccl --json "$json" >>"$LOG" 2>&1
  rc=$?
  if [[ $rc == 0 && -f "$json" ]]; then
    put example_1gpu_nccl "PASS  $($PY -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('; '.join(f\"{r['name']} {r['step_ms']:.2f} ms loss {r['final_loss']:.4f}\" for r in d['runs']))" "$json")"
  else
    put example_1gpu_nccl "FAIL  rc=$rc (see torchnccl_tests.log)"
  fi
fi

echo
echo "================ torchnccl summary ($(date -u +%FT%TZ)) ================"
echo "$caps"
for k in "${ORDER[@]}"; do printf '%-34s %s\n' "$k" "${R[$k]}"; done
for k in "${ORDER[@]}"; do [[ "${R[$k]}" == FAIL* ]] && exit 1; done
exit 0
