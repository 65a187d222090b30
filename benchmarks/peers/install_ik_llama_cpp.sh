#!/usr/bin/env bash
# Build ik_llama.cpp (a llama.cpp fork with its own AVX2 / AVX-512 kernels) — its `llama-server`
# and `llama-quantize` only — outside the project. Never run in CI.
#
#   bash benchmarks/peers/install_ik_llama_cpp.sh
#   # -> $LOOM_PEERS/ik-llama-cpp/bin/llama-server, .../bin/llama-quantize
#
# The source comes from PyPI, the one source of code this machine reaches: the sdist of
# `ik-llama-cpp-python` vendors the whole ik_llama.cpp tree (vendor/ik_llama.cpp), server
# included; its own build makes the Python bindings only, so the two tools are built here with
# cmake from that tree. IK_LLAMA_CPP_SRC=DIR builds from an ik_llama.cpp source tree already on
# disk instead (a checkout of the public repository, where one can be had).
# About 20 minutes on 2 cores with -DGGML_IQK_FA_ALL_QUANTS=OFF (the flash-attention kernels for
# every pair of K/V types are most of the build otherwise), under `nice` so other work goes on.
#
# Env: LOOM_PEERS (default ~/.cache/loom-peers), PYTHON (default python3),
#      IK_LLAMA_CPP_PYTHON_VERSION (default 0.1.5), IK_LLAMA_CPP_SRC (default: from the sdist),
#      JOBS (default: one per core), NICE (default 19), ISA (default native; "avx2": AVX2 + FMA
#      only, for side-by-sides of the AVX2 code paths on a machine that has more).
set -euo pipefail
PEERS="${LOOM_PEERS:-$HOME/.cache/loom-peers}"
DEST="$PEERS/ik-llama-cpp"
PYTHON="${PYTHON:-python3}"
VERSION="${IK_LLAMA_CPP_PYTHON_VERSION:-0.1.5}"
JOBS="${JOBS:-$(nproc)}"
NICE="${NICE:-19}"

mkdir -p "$DEST"
SRC="${IK_LLAMA_CPP_SRC:-}"
if [ -z "$SRC" ]; then
    SRC="$DEST/src/ik_llama_cpp_python-$VERSION/vendor/ik_llama.cpp"
    if [ ! -f "$SRC/CMakeLists.txt" ]; then
        mkdir -p "$DEST/src"
        "$PYTHON" -m pip download --no-deps --no-binary ik-llama-cpp-python -d "$DEST/src" \
            "ik-llama-cpp-python==$VERSION"
        tar -xzf "$DEST/src/ik_llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
    fi
fi
if [ ! -f "$SRC/CMakeLists.txt" ] || [ ! -f "$SRC/examples/server/server.cpp" ]; then
    echo "install_ik_llama_cpp: no ik_llama.cpp source tree with its server at $SRC" >&2
    exit 1
fi
# The server embeds its web UI pages; a tree that lacks a large one (a partial checkout) gets an
# empty placeholder, which only the browser UI would miss.
for asset in public/index.html.gz public_llamacpp/index_llamacpp.html.gz \
             public_llamacpp/loading.html; do
    test -e "$SRC/examples/server/$asset" || : > "$SRC/examples/server/$asset"
done
# The sdist (0.1.5) lacks the script that writes common/build-info.cpp (it reads git, which an
# sdist has not): one that fills the template with "unknown".
GEN="$SRC/common/cmake/build-info-gen-cpp.cmake"
if [ ! -f "$GEN" ]; then
    mkdir -p "$(dirname "$GEN")"
    cat > "$GEN" <<'CMAKE'
set(BUILD_NUMBER 0)
set(BUILD_COMMIT "unknown")
set(BUILD_COMPILER "${CMAKE_C_COMPILER_ID} ${CMAKE_C_COMPILER_VERSION}")
set(BUILD_TARGET "unknown")
configure_file("${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in"
               "${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp")
CMAKE
fi

ISA="${ISA:-native}"
ISA_FLAGS=(-DGGML_NATIVE=ON)
if [ "$ISA" = avx2 ]; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=OFF)
elif [ "$ISA" != native ]; then
    echo "install_ik_llama_cpp: ISA must be native or avx2, not $ISA" >&2
    exit 1
fi
BUILD="$DEST/build"
nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_IQK_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
    "${ISA_FLAGS[@]}"
nice -n "$NICE" cmake --build "$BUILD" --config Release -j "$JOBS" \
    --target llama-server llama-quantize
mkdir -p "$DEST/bin"
for tool in llama-server llama-quantize; do
    cp "$BUILD/bin/$tool" "$DEST/bin/$tool"
done
"$DEST/bin/llama-server" --version 2>&1 | head -n 3 || true
echo "ik_llama.cpp llama-server: $DEST/bin/llama-server"
echo "ik_llama.cpp llama-quantize: $DEST/bin/llama-quantize"
