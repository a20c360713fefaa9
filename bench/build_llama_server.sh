#!/usr/bin/env bash
# Build llama.cpp's `llama-server` with its CUDA backend for Hopper (sm_90), the GPU peer
# of bench/gpu.sh (BENCH_LLAMA_SERVER=BUILD/out/bin/llama-server). The GPU machine has
# nvcc, cmake and ninja but no network, so the source travels: llama.cpp as vendored in the
# llama-cpp-python sdist, pruned to ~4 MB of .tar.xz (docs/benchmarks.md says how).
#   bash bench/build_llama_server.sh SRC.tar.xz BUILD    # ~6 minutes on 16 cores
set -euo pipefail
src=${1:?usage: build_llama_server.sh SRC.tar.xz BUILD}
build=${2:?usage: build_llama_server.sh SRC.tar.xz BUILD}
mkdir -p "$build"
tar xJf "$src" -C "$build"
export PATH=/usr/local/cuda/bin:$PATH
cmake -S "$build/llama.cpp" -B "$build/out" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
cmake --build "$build/out" --target llama-server -j "$(nproc)"
"$build/out/bin/llama-server" --version
