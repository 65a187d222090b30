"""A mixture of experts' router (and a shared expert's gate): a linear layer with few outputs
whose weights stay fp32 whatever the quantization, as llama.cpp keeps them (GGUF files store
`ffn_gate_inp` in F32): which experts a token takes turns on small differences between their
logits, and the router is a sliver of the model's bytes.

On the CPU in fp32 it runs loom_linear_f32 (decoder_q8.c), the kernel the one-call C stack runs
for it too, so both paths give the same bits; elsewhere torch's F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels import cpu_kernels, cpu_ops


class RouterLinear(nn.Module):
    """y = x W^T, W [out_features, in_features] in the activations' dtype, never quantized (not
    an nn.Linear: the quantizers pass it by)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not (cpu_ops.usable(x) and w.dtype == torch.float32 and x.dim() == 2):
            return F.linear(x, w)
        x = x.contiguous()
        out = torch.empty((x.shape[0], self.out_features))  # [num_tokens, out_features]
        cpu_kernels().loom_linear_f32(x.data_ptr(), x.shape[0], self.in_features,
                                      w.data_ptr(), self.out_features, out.data_ptr(),
                                      self.out_features, torch.get_num_threads())
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp32"
