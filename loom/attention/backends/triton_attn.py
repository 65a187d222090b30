"""Paged attention through Loom's Triton kernels (triton_paged.py): the CUDA default.

One kernel serves prefill, decode, chunked prefill, prefix-cache hits and mixed batches: each
query tile reads its request's K/V in place through the block table (no gather, no padded
copy, no mask tensor), grouped-query heads share each K/V load, and decode steps over long
contexts split the key range ("flash decoding") and merge the partials in a second kernel.
K/V may be fp32, bf16, fp16 or FP8 e4m3 with per-KV-head scales.

Everything here reads the step's metadata tensors already on the device and host integers
(num_tokens, the longest query, the longest context from the scheduler's counts): no value
comes back from the device, so a step launches without waiting and a CUDA graph can replay it.
Triton is imported on first use, so a CPU install needs none; on the CPU the kernels run only
in Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check them.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from loom.attention.metadata import AttentionMetadata
from loom.config import ConfigError

if TYPE_CHECKING:
    from loom.attention.layer import Attention

FP8_KV = torch.float8_e4m3fn
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_KV)
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_SPLITS = 16
KEYS_PER_SPLIT = 256  # a split shorter than this costs more in its merge than it saves

_kernels: ModuleType | None = None


def available() -> bool:
    """Whether Triton is installed (its kernels are imported lazily)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels() -> ModuleType:
    global _kernels
    if _kernels is None:
        from loom.attention.backends import triton_paged

        _kernels = triton_paged
    return _kernels


def supported(q: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, kv_heads: int) -> bool:
    """Whether the kernels run for activations like `q` over `kv_cache`: on CUDA (or on the
    CPU under Triton's interpreter), float activations, a float or FP8 cache."""
    return (
        (q.device.type == "cuda" or interpreting())
        and q.dtype in Q_DTYPES
        and kv_cache.dtype in KV_DTYPES
        and kv_cache.stride(-1) == 1
        and num_heads % kv_heads == 0
        and available()
    )


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def max_seq_len(md: AttentionMetadata) -> int:
    """An upper bound of the step's longest context, from host integers alone."""
    return int(md.computed.max()) + md.max_query_len if len(md.computed) else 0


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H200's count, so the split rule is the one tests see


def choose_num_splits(num_tiles: int, kv_heads: int, max_seq: int, sms: int) -> int:
    """Key-range splits: enough programs to fill the GPU twice over, each split at least
    KEYS_PER_SPLIT keys, at most MAX_SPLITS. One for prefill-sized steps.

    Example: 1 decode, 8 KV heads, 8192 keys, 132 SMs -> min(cdiv(264, 8), 8192 // 256, 16) = 16.
    """
    if max_seq < 2 * KEYS_PER_SPLIT:
        return 1
    want = -(-2 * sms // max(1, num_tiles * kv_heads))
    return max(1, min(want, max_seq // KEYS_PER_SPLIT, MAX_SPLITS))


def tile_shape(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q query tokens, GROUP_PAD heads) of a tile: up to 64 rows for prompts, at least
    16 (tl.dot's least M) for decodes."""
    group_pad = _pow2(group)
    block_q = max(1, min(64 // group_pad, _pow2(max_query_len)))
    return max(block_q, 16 // group_pad, 1), group_pad


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """kv_cache [2, num_blocks, block_size, kv_heads, head_dim]; k, v [num_tokens, kv_heads,
    head_dim] written at `slot_mapping` (a slot < 0 is skipped: a CUDA graph's padding row).
    An FP8 cache stores k / k_scale, v / v_scale per KV head."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()  # the kernel walks head_dim densely
    v = v if v.stride(-1) == 1 else v.contiguous()
    fp8 = kv_cache.dtype == FP8_KV
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    if fp8:  # quantized by torch (round to nearest even), the kernel copies bytes
        k = (k.float() / k_scale[:, None]).to(FP8_KV)  # type: ignore[index]
        v = (v.float() / v_scale[:, None]).to(FP8_KV)  # type: ignore[index]
    else:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    cache = kv_cache.view(2, -1, kv_heads, kv_cache.shape[-1])  # [2, slots, kv_heads, d]
    kernels().write_kv_kernel[(num_tokens, kv_heads)](
        k, v, cache[0], cache[1], slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cache.stride(1), cache.stride(2),
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim),
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] in q's dtype.

    `num_splits` (default: choose_num_splits for decode steps, 1 otherwise) may be fixed by a
    caller that needs the same launch every step (a CUDA graph); empty splits cost nothing."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    num_reqs = md.query_start_loc.shape[0] - 1
    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernel walks head_dim densely
    fp8 = kv_cache.dtype == FP8_KV
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    group = num_heads // kv_heads
    block_q, group_pad = tile_shape(group, md.max_query_len)
    num_tiles = num_tokens // block_q + num_reqs
    if num_splits is None:
        num_splits = 1
        if md.max_query_len <= 4:  # decodes (and short drafts): long contexts split
            num_splits = choose_num_splits(num_reqs, kv_heads, max_seq_len(md), num_sms(q.device))
    head_pad = _pow2(head_dim, 16)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if num_splits > 1:
        part_acc = torch.empty((num_splits, num_tokens, num_heads, head_pad),
                               dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unread
    scales = (k_scale, v_scale) if fp8 else (md.seq_lens, md.seq_lens)  # unread unless FP8
    kernels().paged_attention_kernel[(num_tiles, kv_heads, num_splits)](
        q, kv_cache[0], kv_cache[1], md.block_tables, md.query_start_loc, md.seq_lens,
        *scales, out, part_acc, part_m, part_l,
        num_reqs, num_tokens, scale,
        q.stride(0), q.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        md.block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        WINDOW=sliding_window or 0, SOFTCAP=softcap or 0.0, FP8=fp8,
        IEEE=q.dtype == torch.float32, FOR_LOOP=not interpreting(),
        UPCAST=interpreting() and q.dtype == torch.bfloat16,
    )
    if num_splits > 1:
        kernels().combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_m, part_l, out, num_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits, 2),
        )
    return out


def bind_fp8_kv_scales(layers: list[Attention], device: torch.device) -> None:
    """Give each attention layer over an FP8 cache its per-KV-head (k_scale, v_scale): 1.0, as
    vLLM uses when a checkpoint brings no calibrated scales (e4m3 holds +-448, past the K/V
    activations of Llama-family models). The Triton kernels are the only ones that read an FP8
    cache: refused elsewhere."""
    if device.type != "cuda" and not interpreting():
        raise ConfigError("kv_cache_dtype fp8 runs on CUDA (the Triton kernels), not on "
                          f"{device.type}")
    if not available():
        raise ConfigError("kv_cache_dtype fp8 needs Triton (pip install triton)")
    for attn in layers:
        attn.k_scale = torch.ones(attn.num_kv_heads, dtype=torch.float32, device=device)
        attn.v_scale = torch.ones(attn.num_kv_heads, dtype=torch.float32, device=device)
