#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-perplexity (benchmark peers only, never pdserve dependencies) from the
# llama.cpp sources vendored in the llama-cpp-python sdist, into a git-ignored directory.
#
#   bash bench/build_llama_server.sh [DEST]        # DEST defaults to bench/peers
#   -> DEST/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
#   -> DEST/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-perplexity   (bench/bench_quality.py)
#
# Needs cmake, a C/C++ compiler and pip (PyPI). No other network access: the web UI is not built and curl/SSL
# model downloading is off. About 10 minutes on 2 cores. JOBS=N overrides the parallel build jobs.
#
# ggml's AMX kernels are left out (-mno-amx-*) unless LLAMA_AMX=1: built by -march=native on an Intel Xeon with
# AMX, they crashed llama-server at its first matmul here (general protection fault at ldtilecfg, then an invalid
# opcode at tilezero) although AMX itself runs on that machine (checked by hand). The peer then uses its
# AVX512 kernels.
set -euo pipefail

VERSION=0.3.36
DEST=${1:-bench/peers}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
SRC="$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$SRC/build/bin/llama-server"
PPL="$SRC/build/bin/llama-perplexity"

if [[ -x "$BIN" && -x "$PPL" ]]; then
    echo "already built: $BIN $PPL"
    exit 0
fi
if [[ ! -d "$SRC" ]]; then
    python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST"
    tar -xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST"
fi
NO_AMX=""
if [[ "${LLAMA_AMX:-0}" != 1 ]] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "building without ggml's AMX kernels (LLAMA_AMX=1 keeps them)"
fi
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$SRC/build" --target llama-server llama-perplexity -j "$JOBS"
echo "built: $BIN $PPL"
"$BIN" --version 2>&1 | tail -n 2 || true
