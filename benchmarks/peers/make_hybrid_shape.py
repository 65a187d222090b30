"""Write a random-weight hybrid model in a real model's shape, for side-by-side benchmarks.

Qwen3.5-0.8B's text config (its published config.json: hidden 1024, 24 layers of which every
4th attends (8 query heads, 2 KV heads of 256, a quarter-head rotary, base 1e7) and the others
run Gated DeltaNet (16 key and 16 value heads of 128, convolution width 4), MLP 3584, the
248320-token vocabulary, tied embeddings) with random weights and the packaged SmolLM2's
tokenizer (so every engine tokenizes alike). The embedding rows past SmolLM2's 49152 tokens are
zero (their logits 0, so greedy decoding picks real tokens and every engine streams text) but
kept: the head reads all 248320 rows, as the real model's does. Weights normal with std 0.02,
norms at their identity (Qwen3.5's (1 + w) norms: w = 0).

Writes, under OUT (default $LOOM_PEERS/qwen35-0.8b-shape):
  hf/                              the checkpoint (bf16 safetensors) and tokenizer
  qwen35-0.8b-shape-f16.gguf       llama.cpp's converter's file (no MTP head)
  qwen35-0.8b-shape-Q4_K_M.gguf    quantized by llama.cpp's own `llama-quantize` (~0.5 GB)

    .venv/bin/python benchmarks/peers/make_hybrid_shape.py [--out DIR] [--quantize BIN]

Then `bash benchmarks/run_side_by_side.sh qwen35-0.8b`. `--quantize` defaults to the
llama-quantize of benchmarks/peers/install_llama_cpp.sh. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PEERS = Path(os.environ.get("LOOM_PEERS", Path.home() / ".cache" / "loom-peers"))
SMOLLM2_VOCAB = 49152


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(PEERS / "qwen35-0.8b-shape"))
    p.add_argument("--quantize", default=str(PEERS / "llama-cpp" / "bin" / "llama-quantize"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ns = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tiny_models import smollm2_tokenizer

    out = Path(ns.out)
    hf = out / "hf"
    cfg = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True},
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                w.fill_(1.0)  # (the one plain-w norm)
            elif "norm" in name:
                w.zero_()
            elif w.dim() > 1:
                w.normal_(0.0, 0.02)
                if name == "model.embed_tokens.weight":
                    w[SMOLLM2_VOCAB:] = 0
    model.save_pretrained(hf)
    smollm2_tokenizer().save_pretrained(hf)
    f16 = out / "qwen35-0.8b-shape-f16.gguf"
    converter = Path(sys.prefix) / "share" / "llama-cpp-converter" / "convert_hf_to_gguf.py"
    subprocess.run([sys.executable, str(converter), str(hf), "--outtype", "f16", "--no-mtp",
                    "--outfile", str(f16)], check=True)
    subprocess.run([ns.quantize, str(f16), str(out / "qwen35-0.8b-shape-Q4_K_M.gguf"), "Q4_K_M",
                    str(ns.threads)], check=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
