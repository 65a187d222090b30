"""Hugging Face folders: config.json -> ModelConfig, *.safetensors -> (name, tensor) stream."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loom.config import (
    ConfigError, LinearAttnConfig, MambaConfig, ModelConfig, interleaved_layer_types,
)

logger = logging.getLogger(__name__)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers 5 `rope_parameters` or older top-level keys;
    per-layer-type parameters (Gemma 3) give the full-attention layers'."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(params["rope_theta"]), scaling
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def _rotary_dim(cfg: dict[str, Any], head_dim: int, default: float = 1.0) -> int:
    """The dims RoPE rotates: head_dim times `partial_rotary_factor` (top level, as Phi-4-mini
    writes it, or inside rope_parameters / rope_scaling; else `default`, the config class's:
    GLM's 0.5), as transformers rounds it; 0: all."""
    factor = cfg.get("partial_rotary_factor")
    for params in (cfg.get("rope_parameters"), cfg.get("rope_scaling")):
        if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
            params = params["full_attention"]
        if factor is None and isinstance(params, dict):
            factor = params.get("partial_rotary_factor")
    factor = default if factor is None else factor
    if float(factor) == 1.0:
        return 0
    return int(head_dim * float(factor))


def _smollm3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3: the layers without RoPE (`no_rope_layers`: 1 where a layer rotates; default
    every `no_rope_layer_interval`-th, 4, has none), and with `use_sliding_window` the windows of
    the layers its `layer_types` mark sliding."""
    n = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    fields: dict[str, Any] = {"nope_layers": tuple(i for i in range(n) if not flags[i])}
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        fields.update(sliding_window=int(cfg["sliding_window"]),
                      layer_types=tuple(cfg["layer_types"]))
    return fields


def _exaone4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4: with a sliding window, its `layer_types` (three sliding layers to one full)
    and no RoPE on the full ones (transformers' "global NoPE"); without one, every layer full
    and rotated."""
    window, types = cfg.get("sliding_window"), cfg.get("layer_types")
    if not window or not types:
        return {}
    return {"sliding_window": int(window), **global_nope(tuple(types))}


def global_nope(types: tuple[str, ...]) -> dict[str, Any]:
    """`layer_types` whose full layers attend without RoPE (EXAONE 4's hybrid attention)."""
    return {"layer_types": types,
            "nope_layers": tuple(i for i, t in enumerate(types) if t == "full_attention")}


def query_scaled_context(beta: float | None, scaling: dict[str, Any] | None,
                         max_position: int, source: str) -> int:
    """The context a model whose queries are scaled past its original context (Llama 4's and
    Ministral 3's `llama_4_scaling_beta`: q times 1 + beta ln(1 + floor(pos / original))) runs
    exactly in Loom: up to that original context (its RoPE `scaling`'s), where the scale is 1."""
    original = scaling.get("original_max_position_embeddings") if scaling else None
    if not beta or not original or original >= max_position:
        return max_position
    logger.warning("%s scales queries past %d positions (llama_4_scaling_beta %s), which Loom "
                   "does not implement: its context is capped at %d (of %d)", source, original,
                   beta, original, max_position)
    return int(original)


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


_GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GLMS = ("GlmForCausalLM", "Glm4ForCausalLM")  # interleaved partial rotary, attention bias
# sliding_window as the config gives it (Gemma: its sliding layers'; the others: every layer's)
_SLIDING = ("MistralForCausalLM", "Ministral3ForCausalLM", "Phi3ForCausalLM",
            "MixtralForCausalLM", *_GEMMAS)
# Qwen's sliding window applies to some layers only: refused
_QWENS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _gemma_fields(arch: str, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 2/3's own config: interleaved sliding and full layers (each with its RoPE base in
    Gemma 3), the attention scale, soft-capping, GELU-tanh."""
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{path}: {arch} with use_bidirectional_attention is not supported")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:  # older configs: every `pattern`-th layer is global (Gemma 2: every other)
        types = interleaved_layer_types(n, int(
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
            or (6 if arch == "Gemma3ForCausalLM" else 2)))
    local = cfg.get("rope_local_base_freq")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        sliding = params["sliding_attention"]
        if sliding.get("rope_type", "default") != "default":
            raise ConfigError(f"{path}: rope scaling {sliding['rope_type']!r} on the sliding "
                              "layers is not supported")
        local = sliding.get("rope_theta")
    return dict(
        layer_types=tuple(types),
        qk_norm=arch == "Gemma3ForCausalLM",
        rope_local_theta=None if local is None else float(local),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
    )


def _hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's linear layers (its `layer_types`, else every layer but each
    `full_attention_interval`-th), their shape, and the gated attention of the others."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or interleaved_layer_types(
        n, int(cfg.get("full_attention_interval") or 4), "linear_attention")
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown or len(types) != n:
        raise ConfigError(f"layer_types {sorted(unknown) or len(types)} not supported here: "
                          f"{n} of linear_attention / full_attention expected")
    shape = LinearAttnConfig(
        num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))
    return dict(linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                linear_attn=shape, attn_output_gate=True, qk_norm=True)


_HYBRIDS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")


def _lfm2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's config keys under the names the other families use: the MLP's configured
    width is block_ff_dim where the config has it (as transformers reads it: LFM2-1.2B's
    config also holds intermediate_size, the adjusted width, which transformers does not
    read), the norms' eps norm_eps."""
    return {**cfg, "intermediate_size": cfg.get("block_ff_dim") or cfg.get("intermediate_size"),
            "rms_norm_eps": cfg.get("norm_eps", 1e-5),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))}


_LFM2S = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")


def _lfm2_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's convolution layers (its `layer_types`, else all but `full_attn_idxs`), their
    width and bias, the MLP's width as transformers adjusts it (2/3 of the configured one,
    times block_ffn_dim_multiplier, rounded up to block_multiple_of; LFM2-MoE's dense layers
    take it as configured), per-head q/k norms; LFM2-MoE's experts after its first
    num_dense_layers layers, routed by sigmoid scores and a learned bias."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        full = cfg.get("full_attn_idxs")
        full = range(n) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    width = int(cfg["intermediate_size"])
    moe: dict[str, Any] = {}
    if arch == "Lfm2MoeForCausalLM":
        moe = dict(num_experts=int(cfg.get("num_experts", 32)),
                   num_experts_per_tok=int(cfg.get("num_experts_per_tok", 4)),
                   moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1792)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   moe_layers=tuple(range(int(cfg.get("num_dense_layers", 2)), n)),
                   moe_router="sigmoid",
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
        if not cfg.get("use_expert_bias", True):
            raise ConfigError("Lfm2MoeForCausalLM without use_expert_bias is not supported")
    elif cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            step = int(cfg.get("block_multiple_of", 256))
            width = step * -(-int(multiplier * width) // step)
    return dict(linear_layers=tuple(i for i, t in enumerate(types) if t == "conv"),
                short_conv_width=int(cfg.get("conv_L_cache", 3)),
                short_conv_bias=bool(cfg.get("conv_bias", False)),
                intermediate_size=width, qk_norm=True, **moe)


_GRANITES = ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
             "GraniteMoeHybridForCausalLM")
# a hybrid's layer types: transformers 5's names and the checkpoints' (Granite 4.0, Bamba)
_MAMBA_TYPES, _ATTENTION_TYPES = ("linear_attention", "mamba"), ("full_attention", "attention")


def _mamba_shape(cfg: dict[str, Any], prefix: str = "mamba_") -> MambaConfig:
    """The Mamba2 layers' shape from a config's mamba_* keys (transformers' defaults)."""
    def get(name: str, default: Any) -> Any:
        value = cfg.get(prefix + name)
        return default if value is None else value

    heads = int(get("n_heads", 128))
    head_dim = get("d_head", "auto")
    if head_dim == "auto":
        head_dim = int(get("expand", 2)) * int(cfg["hidden_size"]) // heads
    groups = int(get("n_groups", 1))
    low, high = (_float(v) for v in cfg.get("time_step_limit") or (0.0, float("inf")))
    return MambaConfig(
        num_heads=heads, head_dim=int(head_dim), state_size=int(get("d_state", 256)),
        num_groups=groups, conv_kernel=int(get("d_conv", 4)),
        conv_bias=bool(get("conv_bias", True)), proj_bias=bool(get("proj_bias", False)),
        norm_groups=groups, time_step_min=low, time_step_max=high)


def _float(value: Any) -> float:
    """A number of a config, transformers' {"__float__": "Infinity"} for inf included."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _granite_moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's mixtures of experts (every layer's MLP, top-k renormalised; GraniteMoeShared
    and Granite 4.0 add shared_mlp as an ungated shared expert) and Granite 4.0's layers:
    Mamba2 where its layer_types say (a dense shared_mlp where it has no experts), attention
    without positions unless position_embedding_type is "rope"."""
    n = int(cfg["num_hidden_layers"])
    hybrid = arch == "GraniteMoeHybridForCausalLM"
    experts = int(cfg.get("num_local_experts", 8) or 0)
    shared = int(cfg.get("shared_intermediate_size") or 0) if arch != "GraniteMoeForCausalLM" \
        else 0
    fields: dict[str, Any] = {}
    if experts:
        fields.update(num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                      moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                      moe_layers=tuple(range(n)), shared_expert_intermediate_size=shared,
                      shared_expert_gated=False)
    elif hybrid:
        fields.update(intermediate_size=shared)  # shared_mlp: the layer's MLP
    else:
        raise ConfigError(f"{arch} without experts (num_local_experts 0) is not supported")
    if not hybrid:
        return fields
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    unknown = set(types) - {*_MAMBA_TYPES, *_ATTENTION_TYPES}
    if unknown or len(types) != n:
        raise ConfigError(f"layer_types {sorted(unknown) or len(types)} not supported here: "
                          f"{n} of mamba / attention expected")
    linear = tuple(i for i, t in enumerate(types) if t in _MAMBA_TYPES)
    if cfg.get("position_embedding_type") != "rope":
        fields.update(nope_layers=tuple(range(n)))
    if linear:
        fields.update(linear_layers=linear, mamba=_mamba_shape(cfg))
    return fields


# Nemotron-H's block kinds: its hybrid_override_pattern's letters, its layers_block_type's names
_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe",
                   "linear_attention": "mamba", "full_attention": "attention"}


def _nemotron_h_types(cfg: dict[str, Any]) -> list[str]:
    pattern = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or []
    types = [_NEMOTRON_KINDS.get(t, t) for t in pattern]
    unknown = set(types) - {"mamba", "attention", "mlp", "moe"}
    if unknown or not types:
        raise ConfigError(f"Nemotron-H layer kinds {sorted(unknown) or 'missing'}: mamba (M), "
                          "attention (*), mlp (-) and moe (E) expected")
    return types


def _nemotron_h_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's config keys under the names the other families use (its layer count is its
    pattern's length)."""
    return {**cfg, "num_hidden_layers": len(_nemotron_h_types(cfg)),
            "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
            "hidden_act": cfg.get("mlp_hidden_act", "relu2"),
            "intermediate_size": cfg.get("intermediate_size") or cfg.get("moe_intermediate_size")}


def _nemotron_h_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's blocks (Mamba2, attention without positions, ungated relu^2 MLPs and
    mixtures of them), its Mamba2 shape (dt clamped below at time_step_min, as transformers
    does) and its mixtures' group-limited sigmoid router."""
    types = _nemotron_h_types(cfg)
    if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mlp_bias"):
        raise ConfigError("Nemotron-H with an MLP other than an unbiased relu2 one is not "
                          "supported")
    if cfg.get("moe_latent_size") is not None:
        raise ConfigError("Nemotron-H with a latent mixture of experts (moe_latent_size) is not "
                          "supported")
    groups = int(cfg.get("n_groups", 8))
    mamba = MambaConfig(
        num_heads=int(cfg.get("mamba_num_heads", 128)), head_dim=int(cfg.get("mamba_head_dim", 64)),
        state_size=int(cfg.get("ssm_state_size", 128)), num_groups=groups,
        conv_kernel=int(cfg.get("conv_kernel", 4)), conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)), norm_groups=groups,
        time_step_min=_float(cfg.get("time_step_min", 0.001)))
    n = len(types)
    fields: dict[str, Any] = dict(
        linear_layers=tuple(i for i, t in enumerate(types) if t == "mamba"),
        mlp_only_layers=tuple(i for i, t in enumerate(types) if t in ("mlp", "moe")),
        nope_layers=tuple(range(n)), mamba=mamba)
    moe = tuple(i for i, t in enumerate(types) if t == "moe")
    if moe:
        fields.update(
            num_experts=int(cfg.get("n_routed_experts", 8)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]), moe_layers=moe,
            shared_expert_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size")
                                                or 0) * int(cfg.get("n_shared_experts", 1)),
            shared_expert_gated=False, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_router="sigmoid", routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            moe_groups=int(cfg.get("n_group", 1)), moe_topk_groups=int(cfg.get("topk_group", 1)))
    return fields


_MOES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
         "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Experts, top-k, the router's renormalisation, shared expert, which layers are sparse."""
    n = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":  # every layer sparse, top-k always renormalised
        return dict(num_experts=int(cfg["num_local_experts"]),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=tuple(range(n)))
    experts = int(cfg.get("num_experts") or cfg["num_local_experts"])  # transformers 5 renames
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return dict(
        num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0),
        qk_norm=arch == "Qwen3MoeForCausalLM",
        attention_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", False))),
    )


# sentence-transformers' pooling modes -> Loom's
_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def _pooling(folder: Path) -> str:
    """The embedding pooling a sentence-transformers folder declares (modules.json's Pooling
    module), else "last" (a decoder's last token)."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return "last"
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith("Pooling"):
            cfg = json.loads((folder / module["path"] / "config.json").read_text())
            modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
            if len(modes) != 1 or modes[0] not in _POOLING_MODES:
                raise ConfigError(f"{folder}: unsupported embedding pooling {modes}; supported: "
                                  f"{', '.join(_POOLING_MODES)}")
            return _POOLING_MODES[modes[0]]
    return "last"


# Multimodal checkpoints whose text model Loom runs alone: the wrapper -> the text model's
# architecture by its text_config's model_type (the vision tower and projector are not read)
_TEXT_OF = {
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Mistral3ForConditionalGeneration": {"mistral": "MistralForCausalLM",
                                         "ministral3": "Ministral3ForCausalLM"},
    "Qwen3_5ForConditionalGeneration": {"qwen3_5_text": "Qwen3_5ForCausalLM"},
    "Qwen3_5MoeForConditionalGeneration": {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"},
}
# their weights' prefixes (transformers' older and newer layouts) -> the text model's names
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _text_config(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """A multimodal config's text model as a text config of its own: its architecture named,
    the wrapper's token ids where the text config lacks them, and its head tied to the
    embeddings where the checkpoint holds no head of its own (the wrapper's and the text
    config's `tie_word_embeddings` can disagree; the weights are what transformers loads)."""
    arch = cfg["architectures"][0]
    text = dict(cfg.get("text_config") or {})
    kind = text.get("model_type")
    if kind not in _TEXT_OF[arch]:
        raise ConfigError(f"{path}: {arch} with a text model of type {kind!r} is not supported "
                          f"(supported: {', '.join(_TEXT_OF[arch])})")
    for key in ("eos_token_id", "bos_token_id"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    heads = ("lm_head.", "language_model.lm_head.")
    text["tie_word_embeddings"] = not any(n.startswith(heads) for n in _stored_names(path.parent))
    return {**text, "architectures": [_TEXT_OF[arch][kind]]}


def _stored_names(folder: Path) -> list[str]:
    """The tensor names of a folder's safetensors files (their headers alone)."""
    names: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def model_config_from_hf(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    archs = cfg.get("architectures") or []
    if not archs:
        raise ConfigError(f"{path} names no `architectures`")
    if archs[0] in _TEXT_OF:  # its text model alone (images are not read)
        cfg = _text_config(cfg, path)
        archs = cfg["architectures"]
    arch = archs[0]
    if arch in _LFM2S:
        cfg = _lfm2_config(cfg)
    if arch == "NemotronHForCausalLM":
        cfg = _nemotron_h_config(cfg)
    if arch == "Qwen3_5MoeForCausalLM":  # every MLP a mixture (no dense width), the router's
        # top-k always renormalised
        width = cfg.get("intermediate_size") or cfg.get("moe_intermediate_size")
        cfg = {**cfg, "norm_topk_prob": True, "intermediate_size": width}
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        glm = arch in _GLMS
        interleaved = glm or arch == "Ernie4_5ForCausalLM"  # (2i, 2i + 1) pairs
        if arch == "Ernie4_5ForCausalLM" and cfg.get("use_bias"):
            raise ConfigError(f"{path}: Ernie4_5ForCausalLM with use_bias=true is not supported")
        head_dim = int(cfg.get("head_dim") or (128 if interleaved else hidden // heads))
        theta, scaling = _rope(cfg)
        rotary_dim = _rotary_dim(cfg, head_dim,
                                 0.5 if glm else 0.25 if arch in _HYBRIDS else 1.0)
        if scaling is not None:
            scaling.pop("partial_rotary_factor", None)  # (rotary_dim says it)
        sliding = cfg.get("sliding_window") if arch in _SLIDING else None
        if scaling is not None and "original_max_position_embeddings" in cfg:
            scaling.setdefault("original_max_position_embeddings",
                               cfg["original_max_position_embeddings"])  # Phi-3 keeps it apart
        if arch in _QWENS and cfg.get("use_sliding_window"):
            raise ConfigError(f"{path}: use_sliding_window=true is not supported for {arch}")
        eos = _as_tuple(cfg.get("eos_token_id"))
        gen_path = folder / "generation_config.json"
        if gen_path.exists():
            eos = _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id")) or eos
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=query_scaled_context(
                (scaling or {}).get("llama_4_scaling_beta"), scaling,
                int(cfg.get("max_position_embeddings", 4096)), str(path)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             arch == "Ernie4_5ForCausalLM")),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", glm)),
            rotary_interleaved=interleaved,
            qk_norm=arch in ("Qwen3ForCausalLM", "Olmo2ForCausalLM", "Exaone4ForCausalLM"),
            qk_norm_full=arch == "Olmo2ForCausalLM",
            sliding_window=sliding,
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            pooling=_pooling(folder),
        )
        if arch == "SmolLM3ForCausalLM":
            fields.update(_smollm3_fields(cfg))
        if arch == "Exaone4ForCausalLM":
            fields.update(_exaone4_fields(cfg))
        if arch in _GRANITES:
            fields.update(
                embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                attention_multiplier=float(cfg.get("attention_multiplier",
                                                   fields["head_dim"] ** -0.5)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))
        if arch in _GRANITES[1:]:
            fields.update(_granite_moe_fields(arch, cfg))
        if arch in _GEMMAS:
            fields.update(_gemma_fields(arch, cfg, path))
        if arch == "GemmaForCausalLM":  # Gemma 1: Gemma's GELU-tanh and tied embeddings
            fields.update(hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act")
                          or "gelu_pytorch_tanh",
                          tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
        if arch in _MOES:
            fields.update(_moe_fields(arch, cfg))
        if arch in _HYBRIDS:
            fields.update(_hybrid_fields(cfg))
        if arch in _LFM2S:
            fields.update(_lfm2_fields(arch, cfg))
        if arch == "NemotronHForCausalLM":
            fields.update(_nemotron_h_fields(cfg))
        return ModelConfig(**fields)
    except KeyError as e:
        raise ConfigError(f"{path} lacks required key {e.args[0]!r}") from None


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors by name; a multimodal checkpoint's text model's under its text
    model's names, the rest (vision tower, projector) not read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors files")
    config = folder / "config.json"
    wrapped = config.is_file() and (json.loads(config.read_text()).get("architectures")
                                    or [None])[0] in _TEXT_OF
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                name: str | None = stored
                if wrapped:
                    name = next((new + stored[len(old):] for old, new in _TEXT_PREFIXES
                                 if stored.startswith(old)), None)
                    if name is None:
                        continue  # the vision tower, the projector
                yield name, f.get_tensor(stored)
