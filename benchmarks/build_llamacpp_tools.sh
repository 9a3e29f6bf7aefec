#!/usr/bin/env bash
# Build llama.cpp's own llama-batched-bench and llama-server from the very source that the
# installed llama-cpp-python vendors (its sdist on PyPI), so that benchmarks compare
# edgeprefill with llama.cpp's tools on the same kernels. About 5-10 minutes on 2 cores.
#   benchmarks/build_llamacpp_tools.sh [PYTHON] [OUT_DIR]
# Prints the folder holding the two binaries.
set -euo pipefail
PYTHON=${1:-.venv/bin/python}
OUT=${2:-build/llamacpp-tools}
VERSION=$("$PYTHON" -c 'import llama_cpp; print(llama_cpp.__version__)')
SRC="$OUT/llama_cpp_python-$VERSION"
if [ ! -d "$SRC" ]; then
    mkdir -p "$OUT"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$OUT" \
        "llama-cpp-python==$VERSION"
    tar -xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
fi
# The same options llama-cpp-python builds with by default (GGML_NATIVE on); extra CMake
# options (for example -DGGML_AVX512=OFF -DGGML_NATIVE=OFF) come from $CMAKE_ARGS.
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON ${CMAKE_ARGS:-} >&2
cmake --build "$OUT/build" --target llama-batched-bench llama-server -j "$(nproc)" >&2
echo "$OUT/build/bin"
