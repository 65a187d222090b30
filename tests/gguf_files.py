"""Write small GGUF files from tiny Hugging Face checkpoints, the way llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_NAMES = {
    **_NAMES, "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    hf_folder: Path, out: Path, arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    override_arch: str | None = None, overrides: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """`overrides`: another type for the 2-D tensors whose GGUF name holds `.{key}.`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_folder)
    tensors = load_file(str(hf_folder / "model.safetensors"))
    w = GGUFWriter(str(out), override_arch or arch)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    gemma = arch.startswith("gemma")
    if gemma:  # what llama.cpp's converter writes (the norms as 1 + w, below)
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, key, None) is not None:
                getattr(w, f"add_{key}")(getattr(cfg, key))
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    for name, t in tensors.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{(_GEMMA_NAMES if gemma else _NAMES)[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj" and kind == "weight":
                a = _permute(a, heads)
            elif arch == "llama" and module == "self_attn.k_proj" and kind == "weight":
                a = _permute(a, kv)
        if gemma and name.endswith("norm.weight"):
            a = a + 1
        qt = next((t for key, t in (overrides or {}).items() if f".{key}." in gname), qtype)
        if a.ndim == 2 and qt != GGMLQuantizationType.F32:
            w.add_tensor(gname, quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_reference(hf_folder: Path, qtype: GGMLQuantizationType) -> dict[str, torch.Tensor]:
    """What a model stored at `qtype` holds after dequantization (for building the reference)."""
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(str(hf_folder / "model.safetensors")).items():
        a = t.float().numpy()
        if a.ndim == 2 and qtype != GGMLQuantizationType.F32:
            a = dequantize(quantize(a, qtype), qtype)
        out[name] = torch.from_numpy(np.ascontiguousarray(a))
    return out
