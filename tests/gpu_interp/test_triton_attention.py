"""The Triton paged-attention kernels (loom/attention/backends/triton_paged.py), run on the CPU
in Triton's interpreter, against the torch reference backend on small shapes: mixed batches of
prompts, prefix hits and decodes over block tables with holes and shuffled blocks, GQA, sliding
window, soft cap, split-K and an FP8 cache with per-head scales."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from loom.attention.backends import torch_ref, triton_attn  # noqa: E402
from loom.attention.metadata import build_attention_metadata  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_attn.available(), reason="triton is not installed")


def make_step(computed: list[int], new: list[int], block_size: int, num_blocks: int,
              seed: int, holes: bool = True):
    """Metadata for requests with `computed` cached and `new` scheduled tokens, each given
    shuffled, non-contiguous block ids (block 0 stays the null block; with `holes`, unused ids
    lie between them)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in zip(computed, new)]
    free = torch.randperm(num_blocks - 1, generator=g)[: sum(need) * (2 if holes else 1)] + 1
    ids = free[::2] if holes else free
    block_ids, at = [], 0
    for k in need:
        block_ids.append(ids[at : at + k].tolist())
        at += k
    md, _ = build_attention_metadata(block_ids, computed, new, block_size, torch.device("cpu"))
    return md


def random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)


def reference(q, cache, md, scale, window=None, softcap=None):
    mask = torch_ref.build_mask(md, window, torch.float32)
    return torch_ref.paged_attention(q.float(), cache.float(), md, mask, scale, softcap)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# (computed, new): a prompt, a prefix hit continuing in the middle of a block, a chunk, decodes
MIXED = ([0, 5, 12, 9], [7, 3, 1, 1])


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,window,softcap,tol",
    [
        (torch.float32, 4, 2, 16, None, None, 1e-5),
        (torch.bfloat16, 4, 2, 16, None, None, 2e-2),
        (torch.float32, 6, 2, 24, 5, None, 1e-5),  # group of 3, head_dim not a power of two
        (torch.float32, 8, 1, 16, None, 30.0, 1e-5),  # group of 8 (MQA), soft cap
        (torch.float16, 2, 2, 32, 4, None, 2e-2),  # no grouping, fp16
    ],
)
def test_matches_reference_on_mixed_batches(dtype, heads, kv_heads, head_dim, window, softcap,
                                            tol) -> None:
    block_size, num_blocks = 4, 24
    md = make_step(*MIXED, block_size, num_blocks, seed=heads)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=1)
    q = torch.randn(md.num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(2))
    q = q.to(dtype)
    scale = head_dim**-0.5
    out = triton_attn.paged_attention(q, cache, md, scale, window, softcap, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, reference(q, cache, md, scale, window, softcap)) < tol


def test_split_k_decode_matches_one_split_and_reference() -> None:
    """Decodes over 45- and 70-token contexts, keys cut into 4 and 7 splits (some empty)."""
    block_size, num_blocks, heads, kv_heads, head_dim = 8, 40, 4, 2, 16
    md = make_step([44, 69, 3], [1, 1, 1], block_size, num_blocks, seed=5)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32, seed=6)
    q = torch.randn(md.num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(7))
    ref = reference(q, cache, md, 0.25)
    for splits in (1, 4, 7):
        out = triton_attn.paged_attention(q, cache, md, 0.25, num_splits=splits, block_n=16)
        assert rel_err(out, ref) < 1e-5, splits


def test_split_k_with_sliding_window() -> None:
    block_size, num_blocks = 4, 40
    md = make_step([50, 20], [1, 1], block_size, num_blocks, seed=8)
    cache = random_cache(num_blocks, block_size, 2, 16, torch.float32, seed=9)
    q = torch.randn(md.num_tokens, 4, 16, generator=torch.Generator().manual_seed(10))
    out = triton_attn.paged_attention(q, cache, md, 0.25, 24, num_splits=3, block_n=16)
    assert rel_err(out, reference(q, cache, md, 0.25, 24)) < 1e-5


def test_fp8_cache_with_per_head_scales() -> None:
    """The kernel reads e4m3 K/V times each KV head's scale: against the reference on the
    dequantized cache (exact up to fp32 rounding), and on the original values within FP8's
    error."""
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 24, 4, 2, 16
    md = make_step(*MIXED, block_size, num_blocks, seed=11)
    full = random_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32, seed=12)
    k_scale = torch.tensor([0.5, 2.0])
    v_scale = torch.tensor([1.5, 0.25])
    full[0] *= k_scale[:, None] * 3
    full[1] *= v_scale[:, None] * 3
    cache = torch.zeros_like(full, dtype=triton_attn.FP8_KV)
    slots = torch.arange(num_blocks * block_size)
    flat = full.view(2, -1, kv_heads, head_dim)
    triton_attn.write_kv(cache, flat[0], flat[1], slots, k_scale, v_scale)
    deq = cache.float()
    deq[0] *= k_scale[:, None]
    deq[1] *= v_scale[:, None]
    assert rel_err(deq, full) < 0.05  # e4m3 keeps 3 mantissa bits
    q = torch.randn(md.num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(13))
    q = q.to(torch.bfloat16)
    out = triton_attn.paged_attention(q, cache, md, 0.25, k_scale=k_scale, v_scale=v_scale,
                                      block_n=16)
    assert rel_err(out, reference(q, deq, md, 0.25)) < 2e-2
    assert rel_err(out, reference(q, full, md, 0.25)) < 8e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_padding(dtype) -> None:
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 24
    k = torch.randn(5, kv_heads, head_dim).to(dtype)
    v = torch.randn(5, kv_heads, head_dim).to(dtype)
    slots = torch.tensor([9, 3, 17, -1, 4])  # -1: a padded row, written nowhere
    got = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    triton_attn.write_kv(got, k, v, slots)
    want = torch.zeros_like(got)
    keep = slots >= 0
    torch_ref.write_kv(want, k[keep], v[keep], slots[keep])
    assert torch.equal(got, want)


def test_split_rule() -> None:
    assert triton_attn.choose_num_splits(1, 8, 8192, 132) == 16
    assert triton_attn.choose_num_splits(256, 8, 8192, 132) == 1  # the GPU is full already
    assert triton_attn.choose_num_splits(4, 8, 300, 132) == 1  # too short to pay
    assert triton_attn.choose_num_splits(2, 8, 2048, 132) == 8  # 256 keys a split at least
    assert triton_attn.tile_shape(1, 1) == (16, 1)  # decode: tl.dot's 16 rows
    assert triton_attn.tile_shape(4, 1) == (4, 4)
    assert triton_attn.tile_shape(4, 300) == (16, 4)  # prompts: 64 rows
    assert triton_attn.tile_shape(3, 5) == (8, 4)
