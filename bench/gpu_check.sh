#!/usr/bin/env bash
# GPU check: the compiled Triton kernels against their torch references (bf16/fp16 on CUDA) and the engine's
# greedy tokens with Triton vs the torch path (tests/kernels/test_engine_greedy_triton.py), then the kernel
# micro-benchmarks (bench/bench_kernels.py) and the engine against transformers at two models' shapes
# (bench/bench_engine_gpu.py). Fits in 9 minutes: tests <= 200 s, kernel benchmarks <= 200 s (a 150 s budget +
# teardown), engine benchmark <= 150 s. Reports: kernels.md, engine_gpu.md and engine_gpu.json under $OUT when OUT
# is set, else bench/results/. Without CUDA: says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v python || command -v python3)  # GPU images may ship python3 alone
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device available; nothing to check"
    exit 0
fi
unset TRITON_INTERPRET  # compiled kernels; tests/kernels/conftest.py then skips the interpreter-only tests
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

timeout 200 "$PY" -m pytest -m gpu tests/kernels -q -p no:cacheprovider -o addopts="" -rs
tests_rc=$?
echo "gpu_check: kernel tests exit code ${tests_rc}"

timeout 200 "$PY" bench/bench_kernels.py --budget-s 150
bench_rc=$?
echo "gpu_check: kernel benchmark exit code ${bench_rc}"

timeout 150 "$PY" bench/bench_engine_gpu.py
engine_rc=$?
echo "gpu_check: engine benchmark exit code ${engine_rc}"

for rc in "${tests_rc}" "${bench_rc}" "${engine_rc}"; do
    if [ "${rc}" -ne 0 ]; then exit "${rc}"; fi
done
exit 0
