#!/usr/bin/env bash
# tide_xla on CUDA (helper "xlacuda"): the GPU tests of the XLA FFI handlers and the Flax FSDP
# example on the GPUs present. Assumes tide/_core and tide_xla/_ffi are built with CUDA
# (tools/gpu_check.sh's build step). Logs and JSON go to $OUT (or ./gpu_out); a summary table
# is printed LAST.
#
#   export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
#   bash tools/gpu/xlacuda.sh
#
# PASS means: tests/test_xla_gpu.py has no failure (1-GPU mesh, virtual cluster on one GPU vs
# the CPU bitwise, and the 2-GPU mesh tests when >= 2 GPUs), the CPU xla tests still pass with
# the CUDA build, and examples/flax_fsdp.py trains with GSPMD and tide_xla and writes its JSON.
set -uo pipefail
source "$(dirname "$0")/common.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch tests share the GPU; TIDE arenas are cudaMalloc
declare -A R
ORDER=()
t0=$(date +%s)

step() {  # step NAME LOGFILE CMD...: runs CMD, records PASS/FAIL and the last pytest line
  local name=$1 log=$2; shift 2
  ORDER+=("$name")
  if timeout 900 "$@" >"$log" 2>&1; then R[$name]="PASS"; else R[$name]="FAIL (rc $?)"; fi
  local last
  last=$(grep -E "passed|failed|error|skipped" "$log" | tail -1)
  [[ -n "$last" ]] && R[$name]="${R[$name]}  ${last}"
  [[ "${R[$name]}" == FAIL* ]] && { echo "== $name: last lines of $log"; tail -30 "$log"; }
}

$PY -c "import jax, tide_xla._ffi as f; print('jax', jax.__version__, jax.devices(), 'ffi cuda', f.built_with_cuda)" \
  >"$OUT/xlacuda_env.log" 2>&1
cat "$OUT/xlacuda_env.log"

# 1. GPU tests of the CUDA handlers (one process; jax sees every GPU of the machine).
step gpu_tests "$OUT/xlacuda_gpu_tests.log" $PY -m pytest -q -rs tests/test_xla_gpu.py
# 1b. Surface watchdog timeouts per call (debug mode of the runner): the same tests, synchronised.
step gpu_tests_sync "$OUT/xlacuda_gpu_tests_sync.log" env TIDE_XLA_CUDA_SYNC=1 \
  $PY -m pytest -q -x tests/test_xla_gpu.py -k "virtual or one_gpu"
# 2. The CPU xla tests still pass with the CUDA build (host devices only).
step cpu_xla_tests "$OUT/xlacuda_cpu_tests.log" env JAX_PLATFORMS=cpu \
  XLA_FLAGS=--xla_force_host_platform_device_count=8 $PY -m pytest -q \
  tests/test_xla_ffi.py tests/test_xla_all_gather.py tests/test_xla_grads.py \
  tests/test_xla_shard.py tests/test_xla_virtual.py
# 3. The Flax example on the GPUs present (each framework in its own process: per-run peaks).
step example "$OUT/xlacuda_example.log" $PY examples/flax_fsdp.py --steps 30 --separate \
  --json "$OUT/xlacuda_flax_fsdp.json"
if [[ "${R[example]}" == PASS* ]]; then
  summary=$($PY - "$OUT/xlacuda_flax_fsdp.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{d['device']} x{d['world']}: " + ", ".join(
    f"{r['name']} {r['step_ms']:.2f} ms/step loss {r['final_loss']:.3f}" for r in d["runs"]))
PYEOF
)
  R[example]="${R[example]}  $summary"
fi

echo
echo "== xlacuda summary ($(( $(date +%s) - t0 )) s; logs in $OUT)"
printf '%-16s %s\n' ITEM RESULT
for k in "${ORDER[@]}"; do printf '%-16s %s\n' "$k" "${R[$k]}"; done
