#!/usr/bin/env bash
# Issues #8 (nvidia-h200-x2) and #9 (nvidia-h200-x8): the multi-GPU runs, summary last.
# Every stage exists and has run on one H200 (BENCHMARKS.md Runs 9-12); what needs >= 2 GPUs
# (NCCL workers, FSDP2+SymmMem rows, the copy-engine proof, TIDE on devices=[0..N-1], "N nodes x
# 1" rails over NVLink, torchrun + NCCL with the CUDA-IPC fabric, the 2-GPU XLA mesh) has not.
#
#   bash tools/gpu_multi.sh                      # one call, <= 10 min; split with STAGES=...
#   MULTI_DRY_RUN=1 bash tools/gpu_multi.sh      # on one GPU: the same stages, one-GPU subsets
#
# Stages (tools/gpu/<name>.sh): bench = `tide bench ag | rs | interference | train | ag --ce-proof`
# (#8 items 1-3, #9 items 1-2; world = every GPU, both 1 x N and N x 1 topologies); torchgpu =
# 2-GPU NCCL bitwise test + `torchrun --nproc-per-node N examples/fsdp2_llama.py --size 1b` (#8
# item 4, #9 item 3); xlacuda = 2-GPU mesh tests + examples/flax_fsdp.py on every GPU (#8 item 5);
# cudarank = ranks spread over GPUs through the CUDA-IPC fabric; nccl = the NCCL fabric at world 2
# (two processes, one GPU each: AG + RS bitwise, a disagreeing probe raises on both ranks).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TIDE_ENABLE_MULTICAST
n=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if (( n < 2 )) && [[ -z ${MULTI_DRY_RUN:-} ]]; then
  echo "gpu_multi: $n GPU(s) visible; needs >= 2 (MULTI_DRY_RUN=1 runs the one-GPU subsets)" >&2
  exit 2
fi
export BENCH_SKIP=${BENCH_SKIP:-layout}
# the emulated node splits of issue #9 (rails, Bruck rounds, Latin-square waves on real peers)
if (( n == 8 )); then
  export BENCH_TOPOLOGIES=${BENCH_TOPOLOGIES:-1x8,2x4,4x2,8x1}
  export BENCH_NCCL_CTAS=${BENCH_NCCL_CTAS:-default,8,4}  # Table 4 / Fig. 4: NCCL default, <= 8, <= 4 CTAs
fi
export TORCHGPU_TESTS=${TORCHGPU_TESTS:-"test_world2_two_gpus_nccl test_world2_one_gpu_ipc"}
export TORCHGPU_SIZE=${TORCHGPU_SIZE:-1b} TORCHGPU_STEPS=${TORCHGPU_STEPS:-8}
export GPU_CHECK_SKIP=${GPU_CHECK_SKIP:-"kernels bench demo sanitize executor"}
STAGES=${STAGES:-"bench:300 torchgpu:150 xlacuda:70 cudarank:60 nccl:90"} STAGE_TAIL=${STAGE_TAIL:-40} \
  exec bash tools/gpu_all.sh
