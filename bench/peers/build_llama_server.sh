#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-quantize` from the llama.cpp that the
# llama-cpp-python sdist vendors, and writes the F16 GGUF of SmolLM2-135M-Instruct that
# bench/peers.py serves beside the wheel's Q4_1 file. Idempotent: every step whose
# output exists is skipped. Everything lives under $BATCHPILOT_PEERS_CACHE (default
# ~/.cache/batchpilot-peers), never in the repository.
#
#   bench/peers/build_llama_server.sh        # about 5 minutes on 2 cores the first time
#
# Outputs (what bench/peers.py reads):
#   $CACHE/bin/llama-server, $CACHE/bin/llama-quantize
#   $CACHE/weights/SmolLM2-135M-Instruct.F16.gguf
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${BATCHPILOT_PEERS_CACHE:-$HOME/.cache/batchpilot-peers}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-2}"
SRC="$CACHE/src/llama_cpp_python-$VERSION"
BUILD="$CACHE/build/llama.cpp-$VERSION"
F16="$CACHE/weights/SmolLM2-135M-Instruct.F16.gguf"

mkdir -p "$CACHE/src" "$CACHE/build" "$CACHE/bin" "$CACHE/weights"
# run from the cache: the repository's `operator/` folder would shadow the standard
# library's `operator` module for any python started in the repository root
cd "$CACHE"

# 1. The sdist, unpacked (pip download builds its metadata: about a minute).
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
  tarball="$CACHE/src/llama_cpp_python-$VERSION.tar.gz"
  if [ ! -f "$tarball" ]; then
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps \
      "llama-cpp-python==$VERSION" -d "$CACHE/src"
  fi
  tar -xzf "$tarball" -C "$CACHE/src"
fi

# 2. The two tools, CPU only, tuned for this CPU (GGML_NATIVE), no network code.
if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -x "$BUILD/bin/llama-quantize" ]; then
  cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$BUILD.cmake.log" 2>&1 \
    || { tail -n 30 "$BUILD.cmake.log" >&2; echo "cmake failed: $BUILD.cmake.log" >&2; exit 1; }
  nice -n 19 cmake --build "$BUILD" --target llama-server llama-quantize -j"$JOBS" \
    >"$BUILD.build.log" 2>&1 \
    || { grep -m5 -A5 "error:" "$BUILD.build.log" >&2; echo "build failed: $BUILD.build.log" >&2; exit 1; }
fi
ln -sf "$BUILD/bin/llama-server" "$CACHE/bin/llama-server"
ln -sf "$BUILD/bin/llama-quantize" "$CACHE/bin/llama-quantize"

# 3. F16 weights. No 16-bit SmolLM2 checkpoint exists on this machine: the only weights
# are the wheel's Q4_1 GGUF (the Hugging Face directory the parity tests use is that
# file dequantized to float32). So the F16 file holds those same weights widened to
# F16: the bytes a step reads are a real F16 model's, the values are Q4_1's (and the
# same values batchpilot serves in float32 and bfloat16).
if [ ! -f "$F16" ]; then
  q4_1="$("$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1]); import model_refs; print(model_refs.smollm2().source)' "$ROOT/bench")"
  "$CACHE/bin/llama-quantize" --allow-requantize "$q4_1" "$F16.partial" F16 2 \
    >"$CACHE/weights/quantize.log" 2>&1
  mv "$F16.partial" "$F16"
fi

echo "llama-server: $CACHE/bin/llama-server"
echo "F16 weights:  $F16"
