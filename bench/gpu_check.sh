#!/usr/bin/env bash
# GPU check for kernels/: the compiled Triton kernels against their torch references (bf16/fp16 on CUDA) and the
# engine's greedy tokens with Triton vs the torch path (tests/kernels/test_engine_greedy_triton.py), then the
# kernel micro-benchmarks. Fits in 8 minutes: tests <= 200 s, benchmarks <= ~250 s (their own budget + teardown).
# Report: $OUT/kernels.md when OUT is set, else bench/results/kernels.md. Without CUDA: says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device available; nothing to check"
    exit 0
fi
unset TRITON_INTERPRET  # compiled kernels; tests/kernels/conftest.py then skips the interpreter-only tests
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

timeout 200 python -m pytest -m gpu tests/kernels -q -p no:cacheprovider -o addopts="" -rs
tests_rc=$?
echo "gpu_check: kernel tests exit code ${tests_rc}"

timeout 270 python bench/bench_kernels.py --budget-s 200
bench_rc=$?
echo "gpu_check: benchmark exit code ${bench_rc}"

if [ "${tests_rc}" -ne 0 ]; then exit "${tests_rc}"; fi
exit "${bench_rc}"
