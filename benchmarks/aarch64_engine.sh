#!/usr/bin/env bash
# Loom end to end on AArch64 under qemu-user, on any x86 machine: an arm64 Python 3.11 (Debian's
# packages, unpacked), torch 2.6.0's AArch64 CPU wheel (PyPI's torch 2.7+ for AArch64 is the
# CUDA build, whose libraries are not there to load) and Loom's dependencies (pip --platform),
# the kernels built on first use by the cross gcc ($CC: qemu-user runs the x86 compiler
# natively). Each model's default kernels (the CPU's features from the kernel's hwcaps: qemu's
# CPU has dot products: the neon build) and the generic build, greedy, against Loom's float32
# reference on this machine (benchmarks/aarch64_engine.py). Correctness only: qemu's speed is
# not an ARM CPU's. ~1.4 GB of downloads; ~5 minutes a model and build on one core.
# Needs root (apt-get), aarch64-linux-gnu-gcc and qemu-user (`make install-test` installs them).
# Usage: benchmarks/aarch64_engine.sh [MODEL.gguf ...]   (default: the packaged SmolLM2)
#        WORK=/tmp/arm64 keeps the environment between runs (default: a fresh temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-.venv/bin/python}
WORK=${WORK:-$(mktemp -d)}
MODELS=("$@")
if [ ${#MODELS[@]} -eq 0 ]; then
  MODELS=("$($PY -c 'from loom.loader.resolve import resolve_model; print(resolve_model(None).path)')")
fi
mkdir -p "$WORK/debs" "$WORK/root" "$WORK/cache" "$WORK/out"
if [ ! -x "$WORK/root/usr/bin/python3.11" ]; then
  added=; dpkg --print-foreign-architectures | grep -qx arm64 || added=1
  dpkg --add-architecture arm64  # for apt-get download; taken away again below if added here
  apt-get update -q >/dev/null
  (cd "$WORK/debs" && apt-get download -q python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
    libpython3.11-stdlib:arm64 python3.11:arm64 libexpat1:arm64 zlib1g:arm64 libffi8:arm64 \
    libbz2-1.0:arm64 liblzma5:arm64 libssl3:arm64 libsqlite3-0:arm64 libuuid1:arm64 \
    libcrypt1:arm64 libncursesw6:arm64 libtinfo6:arm64 libreadline8:arm64 libstdc++6:arm64 \
    libgcc-s1:arm64 libgomp1:arm64 libc6:arm64 libzstd1:arm64)
  if [ -n "$added" ]; then dpkg --remove-architecture arm64; apt-get update -q >/dev/null; fi
  for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$WORK/root"; done
fi
if [ ! -d "$WORK/site/torch" ]; then
  # pip judges environment markers by this machine (x86-64), so torch's CUDA dependencies for
  # x86-64 would come along: torch without its dependencies, then those it needs on a CPU, and
  # every other dependency of Loom's as pyproject.toml pins it (each has AArch64 wheels)
  pip_arm() {
    $PY -m pip install -q --target "$WORK/site" --only-binary=:all: --python-version 3.11 \
      --implementation cp --abi cp311 --abi abi3 --abi none --platform manylinux_2_28_aarch64 \
      --platform manylinux_2_31_aarch64 --platform manylinux2014_aarch64 \
      --platform manylinux_2_17_aarch64 "$@"
  }
  pip_arm --no-deps torch==2.6.0
  pip_arm filelock typing-extensions sympy networkx fsspec \
    $(sed -n '/^dependencies/,/^]/p' pyproject.toml | grep -v '^ *#' | grep -o '"[^"]*"' \
      | tr -d '"' | sed 's/;.*//' | grep -v '^torch')
fi
arm() {
  PYTHONPATH="$ROOT:$WORK/site" CC=aarch64-linux-gnu-gcc LOOM_CACHE_DIR="$WORK/cache" \
    qemu-aarch64 -L "$WORK/root" "$WORK/root/usr/bin/python3.11" "$@"
}
status=0
for model in "${MODELS[@]}"; do
  name=$(basename "$model" .gguf)
  $PY benchmarks/aarch64_engine.py generate "$model" \
    '{"quantization": "none", "kv_cache_dtype": "float32", "num_threads": 1}' \
    > "$WORK/out/$name-reference.json" 2>"$WORK/out/$name-reference.log"
  for kernels in auto generic; do
    echo "$name: $kernels under qemu-aarch64 ..."
    arm benchmarks/aarch64_engine.py generate "$model" "{\"cpu_kernels\": \"$kernels\", \"num_threads\": 2}" \
      > "$WORK/out/$name-$kernels.json" 2>"$WORK/out/$name-$kernels.log"
  done
  $PY benchmarks/aarch64_engine.py compare "$WORK/out/$name-reference.json" \
    "$WORK/out/$name-auto.json" "$WORK/out/$name-generic.json" || status=1
done
echo "outputs and logs: $WORK/out"
exit $status
