"""Convert a GGUF model (default: Loom's packaged SmolLM2-135M-Instruct) into a Hugging Face
folder of fp32 safetensors, for peers that cannot read GGUF (vLLM).

The GGUF blocks are dequantized by `transformers` (it needs `accelerate` and `gguf`), so the
folder holds the same effective weights llama.cpp and Loom run from the GGUF.

    .venv/bin/python benchmarks/peers/gguf_to_hf.py --out ~/.cache/loom-peers/smollm2-hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the weights
    # are already dequantized, so copy them into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "loom_source.json").write_text(json.dumps({"gguf": str(gguf)}) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default=None, help="the .gguf file (default: the packaged SmolLM2)")
    p.add_argument("--out", required=True, help="output folder")
    ns = p.parse_args()
    if ns.gguf is None:
        from loom.loader.resolve import default_gguf_path

        gguf = default_gguf_path()
    else:
        gguf = Path(ns.gguf)
    if not gguf.is_file():
        sys.exit(f"gguf_to_hf: GGUF file not found: {gguf}")
    out = convert(gguf, Path(ns.out).expanduser())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
