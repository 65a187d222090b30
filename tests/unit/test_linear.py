"""The oneDNN fp32 path of `loom.layers.linear` equals F.linear up to summation order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.layers.linear import ONEDNN_MIN_OUT_FEATURES, Linear, linear


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, ONEDNN_MIN_OUT_FEATURES + 64, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        out = layer(x)
        ref = F.linear(x, layer.weight, layer.bias)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_other_cases_fall_back_to_f_linear() -> None:
    w = torch.randn(ONEDNN_MIN_OUT_FEATURES, 32)
    for x, weight in ((torch.randn(3, 32).bfloat16(), w.bfloat16()),  # not fp32
                      (torch.randn(3, 32), w[:100]),  # narrow
                      (torch.randn(2, 3, 32), w)):  # not 2-D
        with torch.inference_mode():
            assert torch.equal(linear(x, weight), F.linear(x, weight))
    layer = Linear(32, ONEDNN_MIN_OUT_FEATURES)
    assert isinstance(layer, torch.nn.Linear)  # quantization still finds and replaces it
    assert set(layer.state_dict()) == {"weight", "bias"}
    layer.onednn = False
    x = torch.randn(2, 32)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
