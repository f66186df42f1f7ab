#!/usr/bin/env bash
# Tensor parallelism on several GPUs (NCCL): bench/bench_tp.py at TP=1, 2 (and 4 when there are 4 GPUs) on the
# default model, bfloat16. Needs at least 2 CUDA devices (NCCL cannot put two ranks on one GPU); with fewer it
# says so and exits 0. Report: $OUT/tp_gpu.json when OUT is set, else bench/results/tp_gpu.json.
set -uo pipefail
cd "$(dirname "$0")/.."
count=$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "${count}" -lt 2 ]; then
    echo "gpu_tp: ${count} CUDA device(s); tensor parallelism needs at least 2"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
degrees="1,2"
if [ "${count}" -ge 4 ]; then degrees="1,2,4"; fi
timeout 500 python bench/bench_tp.py --device cuda --tp "${degrees}" --prompt-tokens 1024 --decode-tokens 64 \
    --out "${OUT:-bench/results}/tp_gpu.json"
