"""GGUF files: metadata -> ModelConfig, tensors -> Hugging Face-named float tensors."""

from __future__ import annotations


import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loom.config import (
    ConfigError, LinearAttnConfig, MambaConfig, ModelConfig, interleaved_layer_types,
)
from loom.layers.rotary import yarn_mscale
from loom.loader.gguf_file import GGUFFile, GGUFFormatError, read_gguf
from loom.loader.hf import global_nope, query_scaled_context
from loom.loader.release import drop_pages
from loom.models.weight_map import select_rows
from loom.quant.gguf_dequant import dequantize, group_bits, groupable, q8_groups
from loom.quant.int8 import Q8Groups
from loom.quant.kquant import KBlocks, native


class GGUFError(ValueError):
    """The GGUF file is unreadable, truncated or describes something Loom does not run."""


# GGUF `general.architecture` -> registry name; only "llama" stores q/k rows permuted.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "mistral3": "Ministral3ForCausalLM",  # (Mistral Small 3.x and Ministral 3's text models)
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2moe": "Lfm2MoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "nemotron_h_moe": "NemotronHForCausalLM",
}
_NEMOTRON_HS = {"nemotron_h", "nemotron_h_moe"}
_GRANITES = {"granite", "granitemoe", "granitehybrid"}
_LFM2S = {"lfm2", "lfm2moe"}
# written by the converter's LlamaModel
_PERMUTED_QK = {"llama", "smollm3", "mistral3", *_GRANITES, *_NEMOTRON_HS}
_GEMMAS = {"gemma2", "gemma3"}
# Qwen3.5's hybrids and Qwen3-Next
_QWEN35S = {"qwen35", "qwen35moe", "qwen3next"}
# llama.cpp stores these norms' 1 + w (all but Qwen3.5's linear layers' output norm)
_ONE_PLUS_W_NORMS = {"gemma", *_GEMMAS, *_QWEN35S}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused as Hugging Face stores them
    # mixtures of experts: the router, the shared expert and its gate (the experts: _EXPERTS)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# [num_experts, rows, cols] expert tensors -> each expert's Hugging Face projection
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}  # gate and up, fused
_ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# GLM-4's: gate and up fused (as Phi-3's), the norms of attention's and the MLP's outputs
_GLM4_LAYER_NAMES = {
    **_PHI3_LAYER_NAMES,
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}
# OLMo 2's (and EXAONE 4's): no norms before attention and the MLP, the norms of their outputs
_OLMO2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3.5's: the linear layers' tensors (llama.cpp's ssm_* names); ssm_a holds -exp(A_log)
# and ssm_dt.bias the decay's bias (_qwen35_tensor)
_QWEN35_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt",
    "ssm_a": "linear_attn.A",
    "ssm_ba": "linear_attn.in_proj_ba",  # Qwen3-Next's b and a, packed per key head
}
# Granite 4.0-H's Mamba2 layers (ssm_a holds -exp(A_log), ssm_d and ssm_norm come reshaped:
# _mamba_tensor)
_MAMBA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt": "mamba.dt",
    "ssm_a": "mamba.A",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}
# Nemotron-H's: one norm a block (attn_norm), Mamba2's as Granite's, ungated MLPs and experts
_NEMOTRON_H_LAYER_NAMES = {
    **_MAMBA_LAYER_NAMES,
    "attn_norm": "norm",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "exp_probs_b": "mlp.expert_bias",  # its router's bias (stored as a .bias)
}
# LFM2's: its short convolutions (the final norm: _LFM2_GLOBAL_NAMES)
_LFM2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "exp_probs_b": "mlp.expert_bias",  # LFM2-MoE's router bias (stored as a .bias)
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<kind>[.weight|.bias]: ssm_a has no suffix, LFM2's kinds a dot (shortconv.conv)
_LAYER_RE = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?$")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")
# llama.cpp's first Mixtral files: one 2-D tensor an expert, blk.N.ffn_gate.E.weight
_LEGACY_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def open_gguf(path: Path) -> GGUFFile:
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    try:
        return read_gguf(path)
    except (GGUFFormatError, ValueError, IndexError, KeyError, OSError, TypeError) as e:
        raise GGUFError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from None


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.get(key, default)


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    if arch in _LFM2S and gguf_name == "token_embd_norm.weight":
        return "model.norm.weight"  # LFM2's last norm (transformers' embedding_norm)
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = (_GEMMA_LAYER_NAMES if arch in _GEMMAS else _PHI3_LAYER_NAMES if arch == "phi3"
             else _GLM4_LAYER_NAMES if arch == "glm4"
             else _OLMO2_LAYER_NAMES if arch in ("olmo2", "exaone4")
             else _QWEN35_LAYER_NAMES if arch in _QWEN35S
             else _LFM2_LAYER_NAMES if arch in _LFM2S
             else _MAMBA_LAYER_NAMES if arch == "granitehybrid"
             else _NEMOTRON_H_LAYER_NAMES if arch in _NEMOTRON_HS else _LAYER_NAMES)
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in names:
        suffix = "" if m.group(3) is None or m.group(2) == "exp_probs_b" else f".{m.group(3)}"
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}{suffix}"
    m = _LEGACY_EXPERT_RE.match(gguf_name)
    if m:
        return f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}.{m.group(2)}_proj.weight"
    return None


def model_config_from_gguf(reader: GGUFFile, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ConfigError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata key {arch}.{name} is missing")
        return value

    names = {t.name for t in reader.tensors}
    # the multi-token prediction layers converters append (Qwen3.5's nextn): not run
    layers = int(key("block_count")) - int(field(reader, f"{arch}.nextn_predict_layers") or 0)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary_dim = int(field(reader, f"{arch}.rope.dimension_count") or head_dim)
    if rotary_dim < head_dim and arch in _PERMUTED_QK:  # (llama.cpp's GPT-J pairs over n_rot)
        raise ConfigError(f"{path}: a partial rotary ({rotary_dim} of {head_dim} dims) in a "
                          f"{arch!r} GGUF is not supported")
    rotary_dim = 0 if rotary_dim >= head_dim else rotary_dim
    vocab = field(reader, f"{arch}.vocab_size") or reader.count("tokenizer.ggml.tokens")
    scaling = _rope_scaling(reader, arch)
    eos = [field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id")]
    extra = _gemma_fields(reader, arch, path) if arch in _GEMMAS else {}
    if arch in _GEMMAS:  # the end of a chat turn stops generation (llama.cpp's EOG by text)
        eos.append(extra.pop("end_of_turn"))
    if field(reader, f"{arch}.expert_count") and any(
            n.endswith(".ffn_gate_inp.weight") for n in names):
        extra.update(_moe_fields(reader, arch, path))
    architecture = extra.pop("architecture", _ARCHITECTURES[arch])
    # llama.cpp's SmolLM3: every 4th layer without RoPE (n_no_rope_layer_step, not stored)
    extra["nope_layers"] = tuple(range(3, int(key("block_count")), 4)) if arch == "smollm3" \
        else ()
    if arch == "gemma":  # Gemma 1: what llama.cpp fixes rather than stores
        extra.update(hidden_act="gelu_pytorch_tanh")
    if arch == "exaone4":  # sliding layers by the file's flags; the full ones without RoPE
        pattern = field(reader, f"{arch}.attention.sliding_window_pattern")
        if field(reader, f"{arch}.attention.sliding_window") and isinstance(pattern, list):
            extra.update(global_nope(_layer_types(pattern)))
    if arch in _QWEN35S:
        extra.update(_qwen35_fields(reader, arch, layers))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer; 0 where a layer does not attend (LFM2's)
        if arch in _LFM2S:
            extra.update(linear_layers=tuple(i for i, n in enumerate(kv_heads) if not n),
                         short_conv_width=int(key("shortconv.l_cache")),
                         short_conv_bias=any(n.endswith("shortconv.conv.bias") for n in names))
        elif arch == "granitehybrid":
            extra.update(_mamba_fields(reader, arch, kv_heads, names))
        elif arch in _NEMOTRON_HS:
            extra.update(_nemotron_h_fields(reader, arch, kv_heads, names))
        kv_heads = max(kv_heads)
    if arch in _GRANITES:  # its multipliers (llama.cpp's names)
        extra.update(
            embedding_multiplier=float(field(reader, f"{arch}.embedding_scale") or 1.0),
            residual_multiplier=float(field(reader, f"{arch}.residual_scale") or 1.0),
            attention_multiplier=field(reader, f"{arch}.attention.scale"),
            logits_scaling=float(field(reader, f"{arch}.logit_scale") or 1.0))
    shared = int(field(reader, f"{arch}.expert_shared_feed_forward_length") or 0)
    if arch in _GRANITES and shared and not extra.get("num_experts"):
        extra["intermediate_size"] = shared  # Granite 4.0-H's dense MLP (its shared_mlp)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(extra.pop("intermediate_size", None) or key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        # (Nemotron-H's files name it layer_norm_epsilon)
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")
                           or key("attention.layer_norm_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        # Ministral 3's query scaling past the original context (llama.cpp's temperature scale)
        max_position_embeddings=query_scaled_context(
            field(reader, f"{arch}.attention.temperature_scale"), scaling,
            int(key("context_length", 4096)), str(path)),
        tie_word_embeddings="output.weight" not in names,
        # (any layer's: a hybrid's first layer may have no attention)
        attention_bias=any(n.endswith(".attn_q.bias") for n in names),
        qk_norm=any(n.endswith(".attn_q_norm.weight") for n in names),
        qk_norm_full=arch == "olmo2",
        sliding_window=field(reader, f"{arch}.attention.sliding_window"),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        pooling=_pooling(reader, arch, path),
        rotary_interleaved=arch == "glm4",  # llama.cpp's GPT-J pairs over rope.dimension_count
        **extra,
    )


def _qwen35_fields(reader: GGUFFile, arch: str, layers: int) -> dict[str, Any]:
    """Qwen3.5's linear layers (the file's recurrent_layers flags, else all but every
    full_attention_interval-th) and their shape from llama.cpp's ssm keys. The converter
    stores Qwen3.5's value heads of a key head's group tiled (value head j reads key head
    j % key heads), not grouped as Hugging Face does (Qwen3-Next's it leaves grouped)."""
    flags = field(reader, f"{arch}.attention.recurrent_layers")
    if not isinstance(flags, list):
        flags = [t != "full_attention" for t in interleaved_layer_types(
            layers, int(field(reader, f"{arch}.full_attention_interval") or 4))]
    key_heads = int(field(reader, f"{arch}.ssm.group_count"))
    value_heads = int(field(reader, f"{arch}.ssm.time_step_rank"))
    shape = LinearAttnConfig(
        num_key_heads=key_heads, num_value_heads=value_heads,
        key_head_dim=int(field(reader, f"{arch}.ssm.state_size")),
        value_head_dim=int(field(reader, f"{arch}.ssm.inner_size")) // value_heads,
        conv_kernel=int(field(reader, f"{arch}.ssm.conv_kernel")),
        tiled_heads=key_heads != value_heads and arch != "qwen3next")
    return dict(linear_layers=tuple(i for i in range(layers) if flags[i]), linear_attn=shape,
                attn_output_gate=True)


def _mamba_fields(reader: GGUFFile, arch: str, kv_heads: list[int], names: set[str]
                  ) -> dict[str, Any]:
    """Granite 4.0-H's Mamba2 layers (those with no KV heads) and their shape from llama.cpp's
    ssm keys (time_step_rank: the heads); its attention without positions where the file says
    rope.scaling.finetuned false (the converter's switch)."""
    heads = int(field(reader, f"{arch}.ssm.time_step_rank"))
    groups = int(field(reader, f"{arch}.ssm.group_count"))
    shape = MambaConfig(
        num_heads=heads, head_dim=int(field(reader, f"{arch}.ssm.inner_size")) // heads,
        state_size=int(field(reader, f"{arch}.ssm.state_size")), num_groups=groups,
        conv_kernel=int(field(reader, f"{arch}.ssm.conv_kernel")),
        conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in names),
        proj_bias=any(n.endswith(".ssm_in.bias") for n in names), norm_groups=groups)
    rope = field(reader, f"{arch}.rope.scaling.finetuned", True)
    return dict(linear_layers=tuple(i for i, n in enumerate(kv_heads) if not n), mamba=shape,
                nope_layers=() if rope else tuple(range(len(kv_heads))))


def _nemotron_h_fields(reader: GGUFFile, arch: str, kv_heads: list[int], names: set[str]
                       ) -> dict[str, Any]:
    """Nemotron-H's blocks from llama.cpp's per-layer counts: attention where a layer has KV
    heads, an MLP (or mixture) where it has a feed-forward width, Mamba2 where neither (dt
    not clamped: llama.cpp's, where transformers clamps it at time_step_min)."""
    ff = field(reader, f"{arch}.feed_forward_length")
    ff = ff if isinstance(ff, list) else [0] * len(kv_heads)
    fields = _mamba_fields(reader, arch, [k or f for k, f in zip(kv_heads, ff)], names)
    fields.update(mlp_only_layers=tuple(i for i, f in enumerate(ff) if f),
                  nope_layers=tuple(range(len(kv_heads))), hidden_act="relu2",
                  intermediate_size=max(ff))
    if field(reader, f"{arch}.expert_count"):
        fields.update(moe_router="sigmoid", shared_expert_gated=False)
    return fields


def _mamba_tensor(name: str, w: torch.Tensor | Q8Groups | KBlocks
                  ) -> tuple[str, torch.Tensor | Q8Groups | KBlocks]:
    """A Mamba2 tensor as Hugging Face stores it: A_log from -exp(A_log), the time step's bias,
    D and the norm's weight as vectors."""
    if name.endswith(".mamba.A"):
        return name[:-1] + "A_log", torch.log(-w).reshape(-1)
    if name.endswith(".mamba.dt.bias"):
        return name.removesuffix(".dt.bias") + ".dt_bias", w
    if name.endswith((".mamba.D", ".mamba.norm.weight")):
        return name, w.reshape(-1)
    return name, w


def _qwen35_tensor(name: str, w: torch.Tensor | Q8Groups | KBlocks
                   ) -> tuple[str, torch.Tensor | Q8Groups | KBlocks]:
    """A Qwen3.5 tensor as Hugging Face stores it: A_log from -exp(A_log), the decay's
    bias."""
    if name.endswith(".linear_attn.A"):
        return name[:-1] + "A_log", torch.log(-w)
    if name.endswith(".linear_attn.dt.bias"):
        return name.removesuffix(".dt.bias") + ".dt_bias", w
    return name, w


# llama.cpp's LLAMA_POOLING_TYPE values -> Loom's (none: a generation model; its last token)
_POOLINGS = {0: "last", 1: "mean", 3: "last"}


def _pooling(reader: GGUFFile, arch: str, path: Path) -> str:
    kind = field(reader, f"{arch}.pooling_type", 0)
    if kind not in _POOLINGS:
        raise ConfigError(f"{path}: unsupported pooling type {kind} (llama.cpp's numbering); "
                          "supported: 1 (mean), 3 (last)")
    return _POOLINGS[kind]


def _layer_types(pattern: list[bool]) -> tuple[str, ...]:
    """`attention.sliding_window_pattern`'s flags (one a layer: sliding or not) as
    layer_types."""
    return tuple("sliding_attention" if p else "full_attention" for p in pattern)


def _gemma_fields(reader: GGUFFile, arch: str, path: Path) -> dict[str, Any]:
    """What llama.cpp fixes for Gemma 2/3 rather than storing: every 2nd (Gemma 2) or 6th
    (Gemma 3) layer global, the rest sliding; the sliding layers' RoPE base 10000 (Gemma 3);
    the attention scale head_dim ** -0.5, (hidden / heads) ** -0.5 for the 27B models."""
    layers = int(field(reader, f"{arch}.block_count"))
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        types = _layer_types(pattern)
    else:
        types = interleaved_layer_types(layers, int(pattern or (6 if arch == "gemma3" else 2)))
    if field(reader, f"{arch}.attention.sliding_window") is None:
        raise GGUFError(f"{path}: metadata key {arch}.attention.sliding_window is missing")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // heads))
    is_27b = layers == (62 if arch == "gemma3" else 46)
    return dict(
        layer_types=types,
        rope_local_theta=(float(field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
                          if arch == "gemma3" else None),
        query_pre_attn_scalar=float(hidden // heads if is_27b else head_dim),
        attn_logit_softcapping=field(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=field(reader, f"{arch}.final_logit_softcapping"),
        hidden_act="gelu_pytorch_tanh",
        end_of_turn=reader.string_index("tokenizer.ggml.tokens", "<end_of_turn>"),
    )


def _moe_fields(reader: GGUFFile, arch: str, path: Path) -> dict[str, Any]:
    """Experts from llama.cpp's keys; Mixtral is llama.cpp's "llama" with experts. The router
    renormalises its top-k as each family does (llama.cpp: Qwen2-MoE not, the others yes)."""
    gating = field(reader, f"{arch}.expert_gating_func", 2 if arch == "nemotron_h_moe" else 1)
    if gating not in (1, 2) or (gating == 2 and arch not in ("lfm2moe", "nemotron_h_moe")):
        raise ConfigError(f"{path}: expert gating function {gating} (llama.cpp's numbering) is "
                          "not supported; only 1 (softmax), and 2 (sigmoid) for LFM2-MoE and "
                          "Nemotron-H")
    groups = int(field(reader, f"{arch}.expert_group_count") or 1)
    names = {t.name for t in reader.tensors}
    layers = int(field(reader, f"{arch}.block_count"))
    return dict(
        architecture="MixtralForCausalLM" if arch == "llama" else _ARCHITECTURES[arch],
        num_experts=int(field(reader, f"{arch}.expert_count")),
        num_experts_per_tok=int(field(reader, f"{arch}.expert_used_count")),
        moe_intermediate_size=int(field(reader, f"{arch}.expert_feed_forward_length")
                                  or field(reader, f"{arch}.feed_forward_length")),
        shared_expert_intermediate_size=int(
            field(reader, f"{arch}.expert_shared_feed_forward_length", 0)),
        shared_expert_gated=arch not in _GRANITES,  # (Granite's shared_mlp: ungated)
        norm_topk_prob=bool(field(reader, f"{arch}.expert_weights_norm", arch != "qwen2moe")),
        moe_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names),
        moe_router="sigmoid" if gating == 2 else "softmax",
        routed_scaling_factor=float(field(reader, f"{arch}.expert_weights_scale") or 1.0),
        moe_groups=groups,
        moe_topk_groups=int(field(reader, f"{arch}.expert_group_used_count") or groups),
    )


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = field(reader, f"{arch}.rope.scaling.type")
    tensors = {t.name: t for t in reader.tensors if t.name in _ROPE_FACTORS}

    def factors(name: str) -> tuple[float, ...]:
        t = tensors[name]
        return tuple(dequantize(t.data, t.tensor_type, (-1,)).tolist())

    if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE
        return {"rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                "short_factor": factors("rope_factors_short.weight"),
                "original_max_position_embeddings":
                    int(field(reader, f"{arch}.rope.scaling.original_context_length")),
                "attention_factor": field(reader, f"{arch}.rope.scaling.attn_factor")}
    if "rope_freqs.weight" in tensors:  # Llama 3.1 GGUFs store the scaled frequencies' divisors
        return {"rope_type": "freq_factors", "factors": factors("rope_freqs.weight")}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":  # llama.cpp's ramp and mscale are transformers' (attn_factor on top)
        factor = float(field(reader, f"{arch}.rope.scaling.factor"))
        attn = field(reader, f"{arch}.rope.scaling.attn_factor")
        # the multiplier of the mscale of all dims (Ministral 3's mscale_all_dim): llama.cpp's
        # factor mscale(1) / mscale(it), transformers' with mscale 1
        log_mul = field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")
        mscale = (yarn_mscale(factor) / yarn_mscale(factor, float(log_mul)) if log_mul
                  else yarn_mscale(factor))
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings":
                    int(field(reader, f"{arch}.rope.scaling.original_context_length")),
                "beta_fast": field(reader, f"{arch}.rope.scaling.yarn_beta_fast"),
                "beta_slow": field(reader, f"{arch}.rope.scaling.yarn_beta_slow"),
                "attention_factor": mscale * (1.0 if attn is None else float(attn))}
    raise ConfigError(f"unsupported GGUF rope scaling {kind!r}")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_tensors(
    reader: GGUFFile, config: ModelConfig, arch: str, q8: bool = False,
    kq: frozenset[str] = frozenset(), five: bool = True,
) -> Iterator[tuple[str, torch.Tensor | Q8Groups | KBlocks]]:
    """(Hugging Face name, fp32 tensor) per tensor; with `q8`, 2-D tensors in a 32-wide block
    format come as Loom's int8 grid instead (the same values, never materialized in fp32; Q5_0
    / Q5_1 in its 5-bit form where `five`), and the K-quant tensors named in `kq` as their
    blocks (KBlocks, as stored)."""
    permute = arch in _PERMUTED_QK
    for t in reader.tensors:
        if t.name in _ROPE_FACTORS:
            continue
        names = _expert_names(t)
        if names:  # one tensor an expert, in the format the others of its kind get
            experts = _read_experts(t, q8, names[0] in kq, five)
            yield from zip(names, experts)
            _drop_if_copied(t, experts[0])
            continue
        m = _BLOCK_RE.match(t.name)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            continue  # a multi-token prediction layer (not run)
        name = hf_name(t.name, arch)
        if name is None:
            raise GGUFError(f"unexpected GGUF tensor {t.name!r}")
        w = _read(t, q8, name in kq, five=five)
        heads = None
        if permute and name.endswith("q_proj.weight"):
            heads = config.num_attention_heads
        elif permute and name.endswith("k_proj.weight"):
            heads = config.num_key_value_heads
        if heads is not None:
            w = (w.map_rows(lambda a: _unpermute(a, heads))
                 if isinstance(w, (Q8Groups, KBlocks)) else _unpermute(w, heads))
        if name.endswith("shared_expert_gate.weight") and w.dim() == 1:
            w = w[None]  # llama.cpp stores the gate's one row as a vector
        if (arch in _ONE_PLUS_W_NORMS and name.endswith("norm.weight")
                and not name.endswith("linear_attn.norm.weight")):
            w = w - 1  # llama.cpp stores 1 + w; Hugging Face's w, as transformers reads
        if arch in _QWEN35S:
            name, w = _qwen35_tensor(name, w)
        elif arch == "granitehybrid" or arch in _NEMOTRON_HS:
            name, w = _mamba_tensor(name, w)
        yield name, w
        _drop_if_copied(t, w)


def _drop_if_copied(t: Any, w: torch.Tensor | Q8Groups | KBlocks) -> None:
    """Once its consumer has loaded `w`: where `w` holds tensor `t`'s values in memory of its
    own (int8 groups; K-quant blocks are views of the file's), the file's pages are read for
    good and go back (loom.loader.release; most of the map's bytes)."""
    if isinstance(w, Q8Groups):
        drop_pages(t.data.ctypes.data, t.data.ctypes.data + t.data.nbytes)


def _expert_names(t: Any) -> list[str]:
    """The Hugging Face names of a [num_experts, rows, cols] expert tensor's experts ([] for
    any other tensor)."""
    m = _LAYER_RE.match(t.name)
    if not (m and m.group(2) in _EXPERTS):
        return []
    prefix = f"model.layers.{m.group(1)}.mlp.experts"
    return [f"{prefix}.{e}.{_EXPERTS[m.group(2)]}.weight" for e in range(t.shape[0])]


def _expert_shape(t: Any) -> tuple[int, ...]:
    """An expert tensor's experts' rows one under the other: [num_experts * rows, cols]."""
    return (t.shape[0] * t.shape[1], t.shape[2])


def _read_experts(t: Any, q8: bool, kq: bool,
                  five: bool = True) -> list[torch.Tensor | Q8Groups | KBlocks]:
    """An expert tensor's experts, each [rows, cols] as `_read` gives a 2-D tensor (int8
    groups, K-quant blocks or fp32): views of the whole, no copy."""
    w = _read(t, q8, kq, _expert_shape(t), five)
    rows = t.shape[1]
    parts = [slice(e * rows, (e + 1) * rows) for e in range(t.shape[0])]
    return [select_rows(w, r) for r in parts]


def _read(t: Any, q8: bool = False, kq: bool = False, shape: tuple[int, ...] | None = None,
          five: bool = True) -> torch.Tensor | Q8Groups | KBlocks:
    """Tensor `t`'s values in fp32 (in `shape`, default its own); with `q8`, a 2-D tensor in a
    32-wide block format as int8 groups instead; with `kq`, a K-quant tensor's blocks.
    GGUFError naming the tensor where its type cannot be read."""
    shape = tuple(t.shape) if shape is None else shape
    try:
        if kq:
            return KBlocks.from_gguf(t.data, t.tensor_type, shape)
        w = q8_groups(t.data, t.tensor_type, shape, five) if q8 else None
        return dequantize(t.data, t.tensor_type, shape) if w is None else w
    except (ValueError, RuntimeError) as e:  # includes UnsupportedTensorTypeError
        raise GGUFError(f"GGUF tensor {t.name!r} ({t.tensor_type.name}, {t.shape}): {e}") from None


def q8_tensors(reader: GGUFFile, five: bool = True) -> dict[str, int]:
    """Hugging Face name -> bits a weight, of the tensors `iter_gguf_tensors(q8=True, five=five)`
    yields as int8 groups."""
    return {name: group_bits(qtype, five) for name, qtype, shape in matrices(reader)
            if groupable(qtype, shape)}


def kq_tensors(reader: GGUFFile) -> dict[str, str]:
    """Hugging Face name -> K-quant format name, of the 2-D tensors loom.quant.kquant runs as
    stored (the token embedding too: its rows dequantized as looked up, loom.layers.embedding;
    a tied output projection multiplies by its blocks)."""
    return {name: qtype.name for name, qtype, shape in matrices(reader)
            if native(qtype, shape)}


def matrices(reader: GGUFFile) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    """(Hugging Face name, type, shape) of every tensor, an expert tensor's experts each as a
    matrix of its own (their rows one under the other: what `_read_experts` reads)."""
    arch = gguf_architecture(reader)
    for t in reader.tensors:
        names = _expert_names(t)
        if names:
            shape = _expert_shape(t)
            yield from ((name, t.tensor_type, shape) for name in names)
        else:
            yield hf_name(t.name, arch) or t.name, t.tensor_type, tuple(t.shape)


def gguf_architecture(reader: GGUFFile) -> str:
    return str(field(reader, "general.architecture"))
