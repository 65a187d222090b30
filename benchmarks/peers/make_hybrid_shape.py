"""Write a random-weight hybrid model in a real model's shape, for side-by-side benchmarks.

Three shapes (`--shape`), each a published text config with random weights and the packaged
SmolLM2's tokenizer (so every engine tokenizes alike):
- `qwen35-0.8b` (default): Qwen3.5-0.8B's (hidden 1024, 24 layers of which every 4th attends
  (8 query heads, 2 KV heads of 256, a quarter-head rotary, base 1e7) and the others run Gated
  DeltaNet (16 key and 16 value heads of 128, convolution width 4), MLP 3584, the
  248320-token vocabulary, tied embeddings);
- `lfm2-1.2b`: LFM2-1.2B's (hidden 2048, 16 layers of which 6 attend (32 query heads, 8 KV
  heads of 64, base 1e6) and 10 run short convolutions of width 3, MLP 8192, the 65536-token
  vocabulary, tied embeddings);
- `granite4-h-1b`: Granite-4.0-H-1B's (hidden 1536, 40 layers of which 4 attend (12 query
  heads, 4 KV heads of 128, no positions) and 36 run Mamba2 (48 heads of 64, state 128, one
  group, convolution width 4), MLP 4096, the 100352-token vocabulary, tied embeddings).
The embedding rows past SmolLM2's 49152 tokens are zero (their logits 0, so greedy decoding
picks real tokens and every engine streams text) but kept: the head reads every row, as the
real model's does. Weights normal with std 0.02, norms at their identity.

Writes, under OUT (default $LOOM_PEERS/<shape>-shape):
  hf/                          the checkpoint (bf16 safetensors) and tokenizer
  <shape>-shape-f16.gguf       llama.cpp's converter's file (Qwen3.5: no MTP head)
  <shape>-shape-Q4_K_M.gguf    quantized by llama.cpp's own `llama-quantize`

    .venv/bin/python benchmarks/peers/make_hybrid_shape.py [--shape S] [--out DIR]

Then `bash benchmarks/run_side_by_side.sh qwen35-0.8b` (or `lfm2-1.2b`). `--quantize`
defaults to the llama-quantize of benchmarks/peers/install_llama_cpp.sh. A few minutes on 2
cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PEERS = Path(os.environ.get("LOOM_PEERS", Path.home() / ".cache" / "loom-peers"))
SMOLLM2_VOCAB = 49152


def _config(shape: str):  # -> a transformers config
    if shape == "granite4-h-1b":
        from transformers import GraniteMoeHybridConfig

        attention = (5, 15, 25, 35)
        return GraniteMoeHybridConfig(
            vocab_size=100352, hidden_size=1536, intermediate_size=4096,
            shared_intermediate_size=4096, num_hidden_layers=40, num_attention_heads=12,
            num_key_value_heads=4, num_local_experts=0, num_experts_per_tok=0,
            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
            layer_types=["attention" if i in attention else "mamba" for i in range(40)],
            mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
            mamba_d_conv=4, position_embedding_type="nope", eos_token_id=2, pad_token_id=0)
    if shape == "lfm2-1.2b":
        from transformers import Lfm2Config

        return Lfm2Config(
            vocab_size=65536, hidden_size=2048, intermediate_size=12288, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128000,
            norm_eps=1e-5, conv_L_cache=3, conv_bias=False, block_multiple_of=256,
            block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
            full_attn_idxs=[2, 5, 8, 10, 12, 14], tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            eos_token_id=2, pad_token_id=0, bos_token_id=1)
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True},
        eos_token_id=2, pad_token_id=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen35-0.8b",
                   choices=["qwen35-0.8b", "lfm2-1.2b", "granite4-h-1b"])
    p.add_argument("--out", default=None, help="default $LOOM_PEERS/<shape>-shape")
    p.add_argument("--quantize", default=str(PEERS / "llama-cpp" / "bin" / "llama-quantize"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ns = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tiny_models import smollm2_tokenizer

    out = Path(ns.out or PEERS / f"{ns.shape}-shape")
    hf = out / "hf"
    cfg = _config(ns.shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or (
                    not ns.shape.startswith("qwen35") and "norm" in name):
                w.fill_(1.0)  # plain-w norms (Qwen3.5's others scale by 1 + w)
            elif "norm" in name:
                w.zero_()
            elif w.dim() > 1:
                w.normal_(0.0, 0.02)
                if name == "model.embed_tokens.weight":
                    w[SMOLLM2_VOCAB:] = 0
    model.save_pretrained(hf)
    smollm2_tokenizer().save_pretrained(hf)
    if ns.shape.startswith("granite4"):  # the layer types as Granite's checkpoints name them
        config = hf / "config.json"  # (what llama.cpp's converter reads; transformers 5
        cfg = json.loads(config.read_text())  # writes its own names)
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        config.write_text(json.dumps({**cfg, "layer_types": [names.get(t, t) for t in
                                                             cfg["layer_types"]]}))
    f16 = out / f"{ns.shape}-shape-f16.gguf"
    converter = Path(sys.prefix) / "share" / "llama-cpp-converter" / "convert_hf_to_gguf.py"
    subprocess.run([sys.executable, str(converter), str(hf), "--outtype", "f16",
                    *(["--no-mtp"] if ns.shape.startswith("qwen35") else []),
                    "--outfile", str(f16)], check=True)
    subprocess.run([ns.quantize, str(f16), str(out / f"{ns.shape}-shape-Q4_K_M.gguf"),
                    "Q4_K_M", str(ns.threads)], check=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
