"""Reading config.json: where checkpoints put the RoPE fields (Phi-4-mini's partial rotary at
the top level, transformers 5's rope_parameters, older rope_scaling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.config import ConfigError
from loom.loader.hf import model_config_from_hf

PHI4_MINI = {  # microsoft/Phi-4-mini-instruct's config.json, the fields Loom reads
    "architectures": ["Phi3ForCausalLM"], "vocab_size": 200064, "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
    "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
}


def _read(tmp_path: Path, config: dict) -> object:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model_config_from_hf(tmp_path)


def test_phi4_mini_rotates_three_quarters_of_each_head(tmp_path) -> None:
    config = _read(tmp_path, PHI4_MINI)
    assert (config.head_dim, config.rotary_dim, config.rope_dim) == (128, 96, 96)
    assert "partial_rotary_factor" not in config.rope_scaling
    assert config.rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("where", ["rope_parameters", "top"])
def test_partial_rotary_and_yarn_wherever_written(tmp_path, where) -> None:
    base = {k: v for k, v in PHI4_MINI.items()
            if k not in ("rope_scaling", "partial_rotary_factor", "rope_theta")}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    if where == "top":
        base.update(partial_rotary_factor=0.5, rope_theta=1e6, rope_scaling=yarn)
    else:
        base["rope_parameters"] = {"rope_theta": 1e6, "partial_rotary_factor": 0.5, **yarn}
    config = _read(tmp_path, base)
    assert config.rotary_dim == 64 and config.rope_theta == 1e6
    assert config.rope_scaling == yarn


def test_full_rotary_and_bad_fractions(tmp_path) -> None:
    assert _read(tmp_path, {**PHI4_MINI, "partial_rotary_factor": 1.0}).rotary_dim == 0
    with pytest.raises(ConfigError, match="rotary_dim must be even"):
        _read(tmp_path, {**PHI4_MINI, "partial_rotary_factor": 0.2})  # 25 of 128 dims


def test_glm_and_ernie_defaults_are_their_config_classes(tmp_path) -> None:
    """Fields a GLM or ERNIE 4.5 config.json may leave out take transformers' class defaults
    (partial rotary 0.5, attention bias, head_dim 128; ERNIE's tied embeddings), and ERNIE's
    biases on every linear are refused by name."""
    base = {"vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1024,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    glm = _read(tmp_path, {**base, "architectures": ["Glm4ForCausalLM"]})
    assert (glm.head_dim, glm.rotary_dim, glm.rotary_interleaved, glm.attention_bias) == (
        128, 64, True, True)
    ernie = _read(tmp_path, {**base, "architectures": ["Ernie4_5ForCausalLM"]})
    assert (ernie.head_dim, ernie.rotary_dim, ernie.rotary_interleaved,
            ernie.tie_word_embeddings) == (128, 0, True, True)
    with pytest.raises(ConfigError, match="use_bias"):
        _read(tmp_path, {**base, "architectures": ["Ernie4_5ForCausalLM"], "use_bias": True})


LFM2_1_2B = {  # LiquidAI/LFM2-1.2B's config.json, the fields Loom reads
    "architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_dim": 2048,
    "block_ff_dim": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
    "conv_L_cache": 3, "conv_bias": False, "intermediate_size": 8192,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 2048,
    "max_position_embeddings": 128000, "model_type": "lfm2", "norm_eps": 1e-05,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "rope_theta": 1000000.0, "vocab_size": 65536,
}


def test_lfm2_reads_its_own_keys(tmp_path) -> None:
    """The MLP's width from block_ff_dim, adjusted as transformers does (12288 -> 8192; the
    config's intermediate_size, which transformers does not read, adjusted would be 5632),
    the convolution layers from full_attn_idxs, norm_eps, tied embeddings by default."""
    config = _read(tmp_path, LFM2_1_2B)
    assert config.intermediate_size == 8192
    assert config.linear_layers == (0, 1, 3, 4, 6, 7, 9, 11, 13, 15)
    assert (config.short_conv_width, config.rms_norm_eps, config.tie_word_embeddings) == (
        3, 1e-05, True)
    layers = ["conv", "full_attention"] * 8  # a newer config's layer_types, no block_ff_dim
    newer = {k: v for k, v in LFM2_1_2B.items() if k not in ("block_ff_dim", "full_attn_idxs")}
    config = _read(tmp_path, {**newer, "intermediate_size": 12288, "layer_types": layers})
    assert config.intermediate_size == 8192 and config.linear_layers == tuple(range(0, 16, 2))
