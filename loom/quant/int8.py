"""Weight-only INT8: per-output-channel symmetric int8 weights, bf16 activations.

Decode on a CPU is bound by reading weights; int8 reads a quarter of fp32's bytes, and torch's
`_weight_int8pack_mm` kernel runs it directly. Outputs return in the model's dtype. Quality is
tested against the unquantized reference by top-1 agreement and a logit-error bound.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight_int8, self.scale
        ).to(self.out_dtype)  # [num_tokens, out]
        out = out.reshape(*shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias
