"""Paged attention through Loom's C kernel (loom/kernels/csrc/paged_attention.c) on the CPU.

It reads K and V in place in the paged cache: no gather, no padded query copy, no mask tensor.
Each token attends only its own request's context, so a request gets the same bits alone as in
any batch. fp32 activations over an fp32, fp16 or int8 cache; other dtypes, devices and shapes
use the torch reference backend.
"""

from __future__ import annotations

import numpy as np
import torch

from loom.attention.metadata import AttentionMetadata
from loom.kernels import KV_TYPES, cpu_kernels, kv_pointers, kv_type

ROWS_PER_TILE = 64  # query rows (tokens x one kv head's query heads) that share each K/V read
MAX_TILE_FLOATS = 65536  # a part's rows x head_dim must fit the kernel's stack scratch


def supported(
    x: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether the kernel runs for activations like `x` (device, dtype) over `kv_cache`."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and kv_cache.dtype in KV_TYPES
        and kv_cache.is_contiguous()
        and num_heads % kv_heads == 0
        and num_heads * head_dim <= MAX_TILE_FLOATS
        and cpu_kernels() is not None
    )


def tile_tokens(num_heads: int, kv_heads: int, head_dim: int) -> int:
    """Query tokens a tile: the kernel cuts tiles of several tokens by kv head
    (paged_attention.c's tile_parts), each part's rows a token one kv head's query heads."""
    group = num_heads // kv_heads
    return max(1, min(ROWS_PER_TILE // group, MAX_TILE_FLOATS // (group * head_dim)))


def step_tiles(md: AttentionMetadata, num_heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """This step's tiles for the model's head shape: built by the first layer, shared by all."""
    tokens = tile_tokens(num_heads, kv_heads, head_dim)
    tiles = md.tiles.get(tokens)
    if tiles is None:
        tiles = md.tiles[tokens] = build_tiles(md.query_start_loc.numpy(), tokens)
    return tiles


def build_tiles(query_start_loc: np.ndarray, tokens: int) -> np.ndarray:
    """[num_tiles, 3] int64 rows (request, first token, number of tokens): each request's query
    tokens cut into runs of at most `tokens` (paged_attention.c's loom_attention_tiles, the rule
    the C decoder stack cuts its steps by).

    Example: query_start_loc [0, 1, 13], tokens 8 -> [[0, 0, 1], [1, 1, 8], [1, 9, 4]]."""
    qsl = np.ascontiguousarray(query_start_loc, dtype=np.int64)
    tiles = np.empty((int(qsl[-1]), 3), dtype=np.int64)  # room for a tile a token
    n = cpu_kernels().loom_attention_tiles(qsl.ctypes.data, len(qsl) - 1, tokens,
                                           tiles.ctypes.data)
    if n < 0:
        raise ValueError(f"query_start_loc must start at 0 and not decrease, tokens >= 1 "
                         f"(got {qsl.tolist()}, {tokens})")
    return tiles[:n]


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; `softcap`:
    the scaled scores capped as softcap * tanh(score / softcap) before the softmax (Gemma 2)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    tiles = step_tiles(md, num_heads, kv_heads, head_dim)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    rc = cpu_kernels().loom_paged_attention_f32(
        q.data_ptr(), q.stride(0), *kv_pointers(kv_cache),
        md.block_tables.data_ptr(), md.block_tables.shape[1],
        md.positions.data_ptr(),
        tiles.ctypes.data, tiles.shape[0],
        num_heads, kv_heads, head_dim, block_size,
        sliding_window or 0, scale, softcap or 0.0, torch.get_num_threads(), kv_type(kv_cache),
        out.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"paged attention kernel refused its shapes ({num_heads=}, {kv_heads=})")
    return out
