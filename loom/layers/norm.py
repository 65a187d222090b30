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


def qk_norm_(qkv: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int, q_norm: RMSNorm,
             k_norm: RMSNorm) -> None:
    """In place on the CPU in fp32 (cpu_ops.usable): every q and k head of qkv [num_tokens,
    (num_heads + 2 kv_heads) head_dim] (contiguous) RMS-normed by q_norm or k_norm, in one C
    call (norm_act.c, the decoder stack's)."""
    assert qkv.is_contiguous() and q_norm.eps == k_norm.eps
    cpu_kernels().loom_qk_norm_f32(
        qkv.data_ptr(), qkv.shape[1], qkv.shape[0], num_heads, kv_heads, head_dim,
        q_norm.weight.data_ptr(), k_norm.weight.data_ptr(), q_norm.eps, torch.get_num_threads())
