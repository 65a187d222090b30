"""RMSNorm computed in fp32, as Hugging Face's Llama/Qwen implementations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels import cpu_kernels, cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.usable(x) and x.dim() == 2:
            out = x.clone(memory_format=torch.contiguous_format)
            cpu_ops.add_rms_norm_(out, None, self.weight, self.eps)
            return out
        if x.dtype == torch.float32:  # one call, faster, same bits as the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's add and the norm after it.
        On the CPU in fp32 one C kernel does both in place, overwriting x and residual."""
        if cpu_ops.usable(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
            cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class NoNorm(nn.Module):
    """A pre-norm a layer does not have (OLMo 2's before attention and the MLP): the residual
    add alone. The C stack reads it as no norm (a NULL weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return residual, residual


def qk_norm_(qkv: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int, q_norm: RMSNorm,
             k_norm: RMSNorm, full: bool = False) -> None:
    """In place on the CPU in fp32 (cpu_ops.usable): every q and k head of qkv [num_tokens,
    (num_heads + 2 kv_heads) head_dim] (contiguous) RMS-normed by q_norm or k_norm, in one C
    call (norm_act.c, the decoder stack's); `full`: all of q as one row, all of k as another
    (OLMo 2's norms over every head at once), in two."""
    assert qkv.is_contiguous() and q_norm.eps == k_norm.eps
    lib, threads = cpu_kernels(), torch.get_num_threads()
    q_size = num_heads * head_dim
    parts = ((0, 1, 0, q_size), (q_size, 0, 1, kv_heads * head_dim)) if full else (
        (0, num_heads, kv_heads, head_dim),)
    for offset, heads, kv, width in parts:
        lib.loom_qk_norm_f32(qkv.data_ptr() + offset * qkv.element_size(), qkv.shape[1],
                             qkv.shape[0], heads, kv, width, q_norm.weight.data_ptr(),
                             k_norm.weight.data_ptr(), q_norm.eps, threads)
