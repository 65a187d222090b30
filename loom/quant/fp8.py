"""FP8 (E4M3) weights with one scale per output channel, quantized at load (`--quantization
fp8`, as vLLM's dynamic FP8 does for a bf16/fp32 checkpoint).

w8 = round(w / scale) in e4m3 with scale = max|w_row| / 448 (e4m3's largest finite value). On
GPUs with FP8 tensor cores (compute capability 8.9: Ada, 9.0: Hopper) the activations are
quantized per token the same way at each call and `torch._scaled_mm` multiplies the two in FP8
with row-wise scales, accumulating in fp32; elsewhere the weight is expanded to the
activations' dtype at each call (the dequantize fallback: same weights, no speed-up).
Weight bytes are half of bf16's, which is what a memory-bound decode step reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] floats -> (e4m3 [rows, cols], fp32 scales [rows, 1]); w ~ w8 * scale.
    Rounds to nearest even (torch's cast)."""
    scale = (w.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (w8.float() * scale).to(dtype)


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_supported(linear: nn.Linear) -> bool:
    """`_scaled_mm` wants both matrix dimensions in multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w8, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", w8)  # [out, in] e4m3
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out] fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.out_dtype = linear.weight.dtype
        self.use_scaled_mm = scaled_mm_supported(w8.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.use_scaled_mm:
            out = scaled_mm(x2, self.weight_fp8, self.weight_scale, self.bias, self.out_dtype)
        else:
            w = dequantize_rows(self.weight_fp8, self.weight_scale.t(), x.dtype)
            out = F.linear(x2, w, self.bias)
        return out.reshape(*shape[:-1], out.shape[-1])


def scaled_mm(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [tokens, in] (float) @ w8 [out, in].T with w_scale [1, out]: x quantized per token
    (row-wise scales [tokens, 1]), one FP8 product with fp32 accumulation."""
    x8, x_scale = quantize_rows(x)
    mm_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=mm_dtype,
                           bias=None if bias is None else bias.to(mm_dtype))
    return out.to(out_dtype)
