"""Weight-only INT4: asymmetric 4-bit weights in groups of 32 along the input dimension, bf16
activations, through torch's `_weight_int4pack_mm_for_cpu` kernel.

Decode on a CPU is bound by reading weights; int4 reads ~4.5 bits per weight (4 + a bf16 scale
and zero per 32). Each group keeps its min and max exactly representable: q = round((w - min) /
scale), scale = (max - min) / 15, so weights that came from a GGUF Q4_1 tensor (whose groups of
32 are stored exactly that way) are recovered up to the bf16 rounding of scale and zero. Quality
is tested against the unquantized reference by top-1 agreement and a logit-error bound.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32


def int4_supported(linear: nn.Linear) -> bool:
    """The kernel takes whole groups along the input and outputs in multiples of 16."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % 16 == 0


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        out_features, in_features = w.shape
        groups = w.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-10)  # [out, groups, 1]
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32)
        # The kernel computes (q - 8) * scale + zero.
        zero = low + 8 * scale
        scale_zero = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1)
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.view(out_features, in_features), 2))  # [out, in // 2] uint8
        self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16).contiguous())  # [groups, out, 2]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight_int4, GROUP_SIZE,
            self.scale_zero,
        ).to(self.out_dtype)  # [num_tokens, out]
        out = out.reshape(*shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias
