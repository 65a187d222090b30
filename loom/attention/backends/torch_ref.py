"""Reference paged attention in plain torch: correct on any device for mixed batches.

Each layer gathers every request's context from the paged cache, whole blocks at a time (one
row copy per block, K and V apart: far fewer copies than per-slot or two-tensor gathers), into
a padded [num_reqs, max_blocks * block_size] layout, pads queries to [num_reqs, max_query_len],
and runs one scaled_dot_product_attention with a causal (and optional sliding-window) mask. No
Python loop over tokens or requests. The CPU's fp32 default is the C kernel (cpu_kernel.py);
this is the reference it is tested against, and the path for CUDA and other dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.attention.metadata import AttentionMetadata
from loom.quant.int8 import Q8Groups, quantize_groups


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] floats -> int8 cache rows [..., head_dim + head_dim / 4] (bytes): the
    values on the weights' grid (loom.quant.int8.quantize_groups: uint8 in groups of 32), then
    the groups' fp32 scales, then their fp32 minimums. What the C kernel writes, byte for byte.
    Asymmetric: K's outlier channels cost half the logit error of max|x| / 127."""
    *lead, d = x.shape
    q, scales, mins = quantize_groups(x.reshape(-1, d))
    return torch.cat([q, scales.view(torch.uint8), mins.view(torch.uint8)], dim=-1) \
        .view(torch.int8).reshape(*lead, -1)


def dequantize_kv(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int8 cache rows [..., head_dim + head_dim / 4] -> fp32 [..., head_dim]."""
    *lead, width = rows.shape
    flat = rows.reshape(-1, width).view(torch.uint8)
    params = flat[:, head_dim:].contiguous().view(torch.float32)
    groups = Q8Groups(flat[:, :head_dim], *params.chunk(2, dim=-1))
    return groups.dequantize().reshape(*lead, head_dim)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_cache [2, num_blocks, block_size, kv_heads, row]; k, v [num_tokens, kv, head_dim]."""
    _, num_blocks, block_size, kv_heads, row = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, row)
    if kv_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))  # an fp16 cache rounds here
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def build_mask(
    md: AttentionMetadata, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """[num_reqs, 1, max_query_len, max_blocks * block_size] additive mask in `dtype`: 0 where a
    query may attend a key, -inf elsewhere. Additive rather than bool: SDPA turns a bool mask
    into this one on every call, i.e. in every layer; built here once per step."""
    q_pos = md.query_positions[:, :, None]  # [num_reqs, max_q, 1]
    k_pos = md.key_positions[None, None, :]  # [1, 1, num_keys]
    allowed = (k_pos <= q_pos) & (k_pos < md.seq_lens[:, None, None])
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; `softcap`:
    scores capped as softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, row = kv_cache.shape
    num_reqs = md.seq_lens.shape[0]
    # Positions past a request's context (the rest of its last block, padding blocks that point
    # at the null block 0) are masked out; the cache is allocated zeroed, so what they hold is
    # finite and its zero weight cancels it.
    blocks = md.block_tables.view(-1)
    gathered = md.workspace.take((2, blocks.numel(), block_size * kv_heads * row),
                                 kv_cache.dtype, kv_cache.device)
    for i in (0, 1):
        torch.index_select(kv_cache[i].view(num_blocks, -1), 0, blocks, out=gathered[i])
    gathered = gathered.view(2, num_reqs, -1, kv_heads, row)
    if kv_cache.dtype == torch.int8:
        gathered = dequantize_kv(gathered, head_dim)
    k, v = gathered.transpose(2, 3).to(q.dtype)
    # k, v [num_reqs, kv_heads, max_blocks * block_size, head_dim]
    decode_only = md.max_query_len == 1  # token i is request i's only query: no padding
    if decode_only:
        q_pad = q.view(num_reqs, 1, num_heads, head_dim)
    else:
        q_pad = q.new_zeros(num_reqs, md.max_query_len, num_heads, head_dim)
        q_pad[md.token_req_idx, md.token_local_idx] = q
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
            enable_gqa=num_heads != kv_heads,
        )  # [num_reqs, num_heads, max_q, head_dim]
    else:
        out = _softcapped_attention(q_pad.transpose(1, 2), k, v, mask, scale, softcap)
    if decode_only:
        return out.view(num_reqs, num_heads, head_dim)
    return out.transpose(1, 2)[md.token_req_idx, md.token_local_idx]


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with capped scores (SDPA has no cap): q [reqs, heads, max_q, head_dim], k, v
    [reqs, kv_heads, keys, head_dim] -> [reqs, heads, max_q, head_dim]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [reqs, heads, max_q, keys]
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
