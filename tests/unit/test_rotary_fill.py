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
