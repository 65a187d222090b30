"""A CPU rotary table is filled lazily (RotaryEmbedding.ensure): the rows a step reads are the
ones a table computed whole holds, and rows no position reached stay untouched memory."""

from __future__ import annotations

import pytest
import torch

from loom.layers.rotary import FIRST_ROWS, Rope, RotaryEmbedding, rope_freqs

SCALINGS = [None, {"rope_type": "linear", "factor": 2.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}]


def _whole(rotary: RotaryEmbedding) -> torch.Tensor:
    freqs, scale = rope_freqs(rotary.head_dim, rotary.theta, rotary.scaling, rotary.max_position)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat([cos, cos, -sin, sin], dim=-1)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
def test_lazy_rows_are_the_whole_tables(scaling) -> None:
    size = 3 * FIRST_ROWS + 5
    rotary = RotaryEmbedding(64, size, 500000.0, scaling)
    rotary.build_cache(torch.device("cpu"))
    assert rotary.filled == FIRST_ROWS and rotary.cos_sin_cache.shape == (size, 128)
    want = _whole(rotary)
    rotary.ensure(torch.tensor([3, FIRST_ROWS + 1]))  # doubles
    assert rotary.filled == 2 * FIRST_ROWS
    Rope(rotary, torch.tensor([size - 1]), fused=True)  # a step's rotations fill what they read
    assert rotary.filled == size
    torch.testing.assert_close(rotary.cos_sin_cache, want, rtol=0, atol=2e-7)
    with pytest.raises(IndexError, match="past the rotary table"):
        Rope(rotary, torch.tensor([size]), fused=True)


def test_small_tables_are_filled_at_once() -> None:
    rotary = RotaryEmbedding(32, 100, 10000.0, None)
    rotary.build_cache(torch.device("cpu"))
    assert rotary.filled == 100
    assert torch.equal(rotary.cos_sin_cache, _whole(rotary))


YARNS = [
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5's suggested
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek's shape
    {"factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False,
     "attention_factor": 1.25},
]


@pytest.mark.parametrize("params", YARNS, ids=["qwen", "mscale", "untruncated"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.75])
def test_yarn_and_partial_rotary_are_transformers_frequencies(params, rotary_fraction) -> None:
    """YaRN's frequencies and attention factor equal transformers' own computation (for a
    partial rotary too: its frequencies, then angle 0 for the dims that pass)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 128, 1000000.0
    config = Qwen3Config(head_dim=head_dim, max_position_embeddings=131072, rope_parameters={
        "rope_type": "yarn", "rope_theta": theta, "partial_rotary_factor": rotary_fraction,
        **params})
    inv_freq, attn = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rotary_dim = int(head_dim * rotary_fraction)
    freqs, scale = rope_freqs(head_dim, theta, {"rope_type": "yarn", **params}, 131072, 0, 3,
                              rotary_dim)
    want = torch.outer(torch.arange(3, dtype=torch.float32), inv_freq.float())
    torch.testing.assert_close(freqs[:, : rotary_dim // 2], want, rtol=1e-6, atol=0)
    assert (freqs[:, rotary_dim // 2:] == 0).all() and scale == pytest.approx(attn, rel=1e-6)
    # the table: the passed pairs are identity rows (cos 1, sin 0) whatever the scaling
    rotary = RotaryEmbedding(head_dim, 64, theta, {"rope_type": "yarn", **params}, rotary_dim)
    rotary.build_cache(torch.device("cpu"))
    row = rotary.cos_sin_cache[5].view(4, head_dim // 2)
    assert (row[:2, rotary_dim // 2:] == 1).all() and (row[2:, rotary_dim // 2:] == 0).all()
    torch.testing.assert_close(row[0, : rotary_dim // 2], (5 * inv_freq).cos() * attn)


@pytest.mark.parametrize("full", [False, True])
def test_partial_rotary_reorders_q_norms_as_q_rows(full) -> None:
    """A partial rotary reorders each head's q rows; a q norm over one head (Qwen3's) takes a
    head's order, one over all heads (OLMo 2's) the whole q's, so each norm weight stays on
    the row it scales."""
    from loom.config import ModelConfig
    from loom.models.llama import _partial_rotary_rows

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=16,
                         intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, rotary_dim=4, qk_norm=True,
                         qk_norm_full=full)
    q = torch.arange(16.0)
    norm = q.clone() if full else q[:8].clone()
    out = dict(_partial_rotary_rows([("model.layers.0.self_attn.q_proj.weight", q[:, None]),
                                     ("model.layers.0.self_attn.q_norm.weight", norm)], config))
    rows = out["model.layers.0.self_attn.q_proj.weight"][:, 0]
    assert not torch.equal(rows, q)  # reordered
    assert torch.equal(out["model.layers.0.self_attn.q_norm.weight"], rows if full else rows[:8])
