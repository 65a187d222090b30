"""Linear layer with a faster fp32 CPU path for wide outputs.

On this CPU class (AVX2, MKL), `F.linear` with a wide weight ([N >= 2048, K]: the fused
gate/up projection, the vocabulary projection) runs at about half the speed of oneDNN's linear
on the same fp32 weight, at every batch size measured (1 to 256 rows; docs/cpu_kernels.md).
Narrow layers are no faster, so they keep `F.linear`.
Same weight layout, same fp32 arithmetic up to summation order (relative error ~1e-6).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Output width from which oneDNN's fp32 linear beats F.linear (measured; see the module doc).
ONEDNN_MIN_OUT_FEATURES = 2048


@functools.cache
def _has_onednn() -> bool:
    """Looked up on first use, so a model that never takes this path never touches oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN for fp32 CPU tensors with a wide weight."""
    if (weight.size(0) >= ONEDNN_MIN_OUT_FEATURES and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and not torch.is_grad_enabled() and _has_onednn()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) whose forward is `linear` above; weight-only
    quantization still replaces it like any `nn.Linear`. `onednn = False` keeps F.linear."""

    onednn = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.onednn:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)
