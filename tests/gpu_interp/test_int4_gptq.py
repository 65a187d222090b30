"""INT4 weight-only linears from GPTQ and AWQ layouts (loom/quant/gptq.py) and the Triton
dequant-GEMM (loom/quant/int4_triton.py), run in Triton's interpreter on the CPU against
dequantize-then-matmul. The packed tensors are built here from the formats' definitions, one
nibble at a time, independently of the unpacking code under test."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from loom.quant.gptq import (  # noqa: E402
    AWQ_ORDER, Int4GptqLinear, dequantize, from_awq, from_gptq, int4_matmul,
)

K, N, GROUP = 256, 80, 128
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")


def _word(nibbles: list[int]) -> int:
    v = sum(int(x) << (4 * j) for j, x in enumerate(nibbles))
    return v - (1 << 32) if v >= 1 << 31 else v  # as int32


def reference_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // GROUP, N), generator=g)
    s = (torch.rand(K // GROUP, N, generator=g) * 0.02 + 0.005).half()
    w = (q - z.repeat_interleave(GROUP, 0)).float() * s.float().repeat_interleave(GROUP, 0)
    return q, z, s, w


def pack_gptq(q, z):
    qweight = torch.tensor([[_word(q[8 * r : 8 * r + 8, c].tolist()) for c in range(N)]
                            for r in range(K // 8)], dtype=torch.int32)
    zm1 = z - 1  # GPTQ stores zero - 1
    qzeros = torch.tensor([[_word((zm1[gi, 8 * c : 8 * c + 8] & 0xF).tolist())
                            for c in range(N // 8)] for gi in range(K // GROUP)],
                          dtype=torch.int32)
    return qweight, qzeros


def pack_awq(q, z):
    def cols(m, r, c):  # nibble j holds column AWQ_ORDER[j]
        return _word([m[r, 8 * c + AWQ_ORDER[j]].item() for j in range(8)])
    qweight = torch.tensor([[cols(q, r, c) for c in range(N // 8)] for r in range(K)],
                           dtype=torch.int32)
    qzeros = torch.tensor([[cols(z, r, c) for c in range(N // 8)] for r in range(K // GROUP)],
                          dtype=torch.int32)
    return qweight, qzeros


def test_layouts_dequantize_exactly() -> None:
    q, z, s, w = reference_weights(0)
    z = z.clamp(min=1)  # GPTQ's zero - 1 must stay a nibble
    w = (q - z.repeat_interleave(GROUP, 0)).float() * s.float().repeat_interleave(GROUP, 0)
    for canon in (from_gptq(*pack_gptq(q, z), s, torch.arange(K) // GROUP),
                  from_awq(*pack_awq(q, z), s)):
        assert torch.equal(dequantize(*canon, torch.float32), w)
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(*pack_gptq(q, z), s, torch.arange(K).flip(0) // GROUP)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_gemm_matches_dequantize_then_matmul(dtype, tol) -> None:
    q, z, s, w = reference_weights(1)
    canon = from_awq(*pack_awq(q, z), s)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = int4_matmul(x, *canon)  # 5 rows, 80 columns: both edges masked
    want = x.float() @ w
    assert got.dtype == dtype and got.shape == (5, N)
    assert ((got.float() - want).norm() / want.norm()).item() < tol


@needs_triton
def test_linear_module_kernel_and_fallback_agree(monkeypatch) -> None:
    q, z, s, _ = reference_weights(3)
    layer = Int4GptqLinear(*from_awq(*pack_awq(q, z), s), bias=torch.randn(N))
    x = torch.randn(2, 3, K)
    kernel = layer(x)
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU's dequantize fallback
    fallback = layer(x)
    assert kernel.shape == (2, 3, N)
    assert torch.allclose(kernel, fallback, rtol=1e-4, atol=1e-4)
