"""Attention layer: writes new K/V into its paged cache, then attends over the context."""

from __future__ import annotations

import torch
from torch import nn

from loom.attention.backends import cpu_kernel, torch_ref, triton_attn
from loom.attention.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
        scale: float | None = None, softcap: float | None = None,
    ) -> None:
        """`sliding_window`: a query attends the last that many positions (itself included);
        `scale` multiplies q.k (default head_dim ** -0.5); `softcap` caps the scaled scores as
        cap * tanh(score / cap) (Gemma 2)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the model runner.
        self.kv_cache = torch.empty(0)
        self.use_kernel: bool | None = None  # the C kernel when it can run here; decided once
        # The Triton kernels (CUDA's default where Triton is installed); decided once. An FP8
        # cache's per-KV-head scales [num_kv_heads] are bound with the cache.
        self.use_triton: bool | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim] to write
        into the cache first, or None when the caller already wrote them."""
        md = get_forward_context().attn_metadata
        if self.use_triton is None:
            self.use_triton = q.device.type == "cuda" and triton_attn.supported(
                q, self.kv_cache, self.num_heads, self.num_kv_heads)
        if self.use_triton:
            if k is not None:
                triton_attn.write_kv(self.kv_cache, k, v, md.slot_mapping, self.k_scale,
                                     self.v_scale)
            return triton_attn.paged_attention(
                q, self.kv_cache, md, self.scale, self.sliding_window, self.softcap,
                self.k_scale, self.v_scale, md.num_kv_splits)
        if k is not None:
            torch_ref.write_kv(self.kv_cache, k, v, md.slot_mapping)
        if self.use_kernel is None:
            self.use_kernel = cpu_kernel.supported(
                q, self.kv_cache, self.num_heads, self.num_kv_heads, self.head_dim
            )
        if self.use_kernel:
            return cpu_kernel.paged_attention(q, self.kv_cache, md, self.scale, self.sliding_window,
                                              self.softcap)
        mask = md.masks.get(self.sliding_window)
        if mask is None:
            mask = md.masks[self.sliding_window] = torch_ref.build_mask(
                md, self.sliding_window, q.dtype
            )
        return torch_ref.paged_attention(q, self.kv_cache, md, mask, self.scale, self.softcap)
