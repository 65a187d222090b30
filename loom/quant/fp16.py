"""Weight-only FP16: fp16 weights, fp32 activations and accumulation, through fbgemm's packed
fp16 GEMM (`quantized::linear_dynamic_fp16`, x86 CPUs).

Decode on a CPU is bound by reading weights, and fbgemm's packed fp16 kernel reads half of
fp32's bytes while staying fast when many rows share a step. Measured on the 2-core AVX2 machine
over SmolLM2's 30 layers + vocabulary projection, streamed from memory (ms per step, 1 / 8 /
32 / 64 rows): fp32 `F.linear` 66 / 129 / 205 / 276, oneDNN fp32 51 / 92 / 146 / 184, fp16
25 / 36 / 88 / 134; torch's int4 kernel 13.5 / 46 / 189 / 267. fp16 keeps 11 bits of each
weight, so it is near lossless (GGUF Q4_1 / Q8_0 weights are fp16 scale x small integer).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def fp16_available() -> bool:
    """fbgemm, and with it the packed fp16 GEMM, is built into torch for x86 CPUs only."""
    return "fbgemm" in torch.backends.quantized.supported_engines


# fbgemm packs a wide weight (a vocabulary's output projection) faster as slices than whole,
# and the slices run no slower, with the same bits: wide layers are packed in slices.
MAX_PACKED_ROWS = 8192


class Fp16Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().float()
        # Each packed slice is an opaque fbgemm object (fp16, laid out for the kernel).
        self.packed = [
            torch.ops.quantized.linear_prepack_fp16(
                weight[i : i + MAX_PACKED_ROWS].float().contiguous(),
                None if bias is None else bias[i : i + MAX_PACKED_ROWS].contiguous(),
            )
            for i in range(0, self.out_features, MAX_PACKED_ROWS)
        ]

    # fbgemm's fp16 GEMM sums a row in an order that depends on how many rows its call has
    # (on an AVX2 Zen 3: one order at one row, another at two, another at three or more). The
    # batch-invariant mode (loom.loader.model_loader._quantize) sets this: each row is a call
    # of its own (one-row calls agree whatever the thread count), so the weights are read
    # once a row.
    row_by_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if self.row_by_row and x2.shape[0] > 1:
            rows = [self._linear(x2[i : i + 1]) for i in range(x2.shape[0])]
            return torch.cat(rows).reshape(*shape[:-1], self.out_features).to(x.dtype)
        return self._linear(x2).reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _linear(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, in] fp32 -> [rows, out] fp32
        outs = [torch.ops.quantized.linear_dynamic_fp16(x2, p) for p in self.packed]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16"
