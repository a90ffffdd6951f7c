# Sourced first by the tools/gpu/<name>.sh stage scripts: the repo root as working directory,
# $OUT (default ./gpu_out), $PY, and the safety environment (ARCHITECTURE.md: multicast stays
# off, nothing here creates a multicast object or changes a GPU setting).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
unset TIDE_ENABLE_MULTICAST
# Several ranks' streams may share one GPU: every hardware queue (never 1, NCCL #2238).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
