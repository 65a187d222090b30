"""FP8 (e4m3) weights with per-output-channel scales (loom/quant/fp8.py), on the CPU: the
quantize / dequantize round trip, both matmul paths (torch._scaled_mm runs on the CPU too), and
`--quantization fp8` on a tiny checkpoint; the FP8 KV cache's CPU refusal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ConfigError
from loom.quant.fp8 import FP8_MAX, Fp8Linear, dequantize_rows, quantize_rows
from loom.worker.kv_cache import kv_cache_dtype


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_round_trip_within_e4m3_error() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3] = 0.0  # an all-zero row keeps a finite scale
    w8, scale = quantize_rows(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = dequantize_rows(w8, scale, torch.float32)
    assert torch.isfinite(back).all() and back[3].abs().max() == 0
    assert rel(back, w) < 0.04  # 3 mantissa bits: ~2.5% RMS
    # each row's largest magnitude lands on e4m3's largest value, exactly
    assert torch.equal(w8.float().abs().amax(1)[w.abs().amax(1) > 0],
                       torch.full((63,), FP8_MAX))


@pytest.mark.parametrize("scaled_mm", [False, True])
def test_linear_paths(scaled_mm: bool) -> None:
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
        linear.bias.copy_(torch.randn(48, generator=g))
    linear = linear.to(torch.bfloat16)
    q = Fp8Linear(linear)
    q.use_scaled_mm = scaled_mm  # the FP8 product (Hopper/Ada on CUDA; torch runs it here)
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    out = q(x)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    w = dequantize_rows(q.weight_fp8, q.weight_scale.t(), torch.float32)
    exact_w = F.linear(x.float(), w, linear.bias.float())
    assert rel(out, exact_w) < (0.05 if scaled_mm else 0.01)  # activations in FP8 too
    assert rel(out, linear(x)) < 0.06


def test_quantization_fp8_at_load(tmp_path) -> None:
    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from tests.paged_batch import PagedBatch
    from tests.tiny_models import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "llama")
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = {}
    for quant in ("none", "fp8"):
        loaded = load_model(resolve_model(str(folder)), "bfloat16", "cpu", quantization=quant)
        logits[quant] = PagedBatch(loaded).step({"r": ids})["r"].float()
    fp8 = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * 2  # qkv, o, gate_up, down in each of 2 layers; the head stays
    assert isinstance(loaded.model.lm_head, nn.Linear)
    assert loaded.quantization == "fp8"
    assert rel(logits["fp8"], logits["none"]) < 0.1
    top1 = (logits["fp8"].argmax(-1) == logits["none"].argmax(-1)).float().mean().item()
    assert top1 >= 0.8


def test_fp8_kv_cache_is_cuda_only(monkeypatch) -> None:
    from loom.attention.backends.triton_attn import bind_fp8_kv_scales

    assert kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="fp8 runs on CUDA"):
        bind_fp8_kv_scales([], torch.device("cpu"))
