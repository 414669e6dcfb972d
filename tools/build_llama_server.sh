#!/usr/bin/env bash
# Build native llama-server (the fair CPU peer) from the llama.cpp source vendored in the PyPI sdist of
# llama-cpp-python: no download outside the package registry. Usage:
#   tools/build_llama_server.sh [DEST_DIR]   (default /work/cache/llama-server; prints the binary's path)
# GGML_NATIVE (-march=native) compiles llama.cpp's AMX path in on a CPU that has AMX-INT8: its
# system_info line then says AMX_INT8 = 1 and the log "AMX model buffer" (2026-12-05, Intel Xeon).
# (-DGGML_AMX is no option of this llama.cpp; it changes nothing.) Cached: a second run returns
# at once.
set -euo pipefail
DEST="${1:-/work/cache/llama-server}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-python3}"
BIN="$DEST/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$DEST/src"
cd "$DEST/src"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d . >&2
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
cd "llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -B build -DGGML_AMX=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >&2
cmake --build build --target llama-server -j"${JOBS:-2}" >&2
mkdir -p "$DEST/bin"
cp build/bin/llama-server "$BIN"
echo "$BIN"
