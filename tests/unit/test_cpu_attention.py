"""The C paged-attention kernel against a float64 per-token reference and the torch backend:
mixed prefill/decode batches, prefix-cached contexts, GQA/MQA/MHA, head sizes, block sizes,
sliding windows, Gemma 2's soft cap; a request's bits do not depend on its batch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from loom.attention.backends import cpu_kernel, torch_ref
from loom.attention.metadata import build_attention_metadata
from tests import background
from tests.cpu_kernels import require_cpu_kernels


@pytest.fixture(autouse=True)
def _kernels() -> None:
    require_cpu_kernels()


def make_batch(computed, qlens, num_heads, kv_heads, head_dim, block_size, seed=0):
    """A cache with every request's context in shuffled blocks (block 0 left as the null block)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in zip(computed, qlens)]
    ids = (torch.randperm(sum(need) + 4, generator=g) + 1).tolist()  # blocks 1.., not in order
    blocks, k = [], 0
    for n in need:
        blocks.append(ids[k : k + n])
        k += n
    cache = torch.randn(2, max(ids) + 1, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=g)
    md, positions = build_attention_metadata(blocks, computed, qlens, block_size, torch.device("cpu"))
    return cache, q, md, positions, blocks


def reference(cache, q, blocks, computed, qlens, window, softcap=None, scale=None):
    """float64, one token and head at a time, straight from the definition."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for blk, c, n in zip(blocks, computed, qlens):
        slots = torch.tensor([blk[p // block_size] * block_size + p % block_size for p in range(c + n)])
        keys = cache[0].reshape(-1, kv_heads, cache.shape[-1])[slots].double()
        vals = cache[1].reshape(-1, kv_heads, cache.shape[-1])[slots].double()
        for i in range(n):
            pos = c + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(q.shape[1]):
                s = keys[lo : pos + 1, h // group] @ q[t, h].double() * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[t, h] = torch.softmax(s, 0) @ vals[lo : pos + 1, h // group]
            t += 1
    return out


CASES = [
    # computed, query lens, heads, kv heads, head dim, block size, window
    ([37], [1], 9, 3, 64, 16, None),  # one decode (SmolLM2's shape)
    ([0, 100, 3, 17], [5, 1, 40, 1], 9, 3, 64, 16, None),  # prefills, decodes, cached prefixes
    ([0, 21], [70, 1], 8, 8, 128, 16, 7),  # multi-head, sliding window shorter than a block
    ([0, 5], [33, 2], 32, 4, 64, 32, 20),  # more heads than one tile row budget
    ([0], [300], 4, 1, 96, 8, None),  # multi-query, head size with no specialization
    ([15, 16, 17], [1, 16, 2], 2, 2, 80, 16, 16),  # block boundaries
    ([300, 0, 77], [1, 20, 1], 4, 1, 256, 16, None),  # Gemma 3: one kv head, 256 wide
]


@pytest.mark.parametrize("computed,qlens,heads,kv_heads,head_dim,block_size,window", CASES)
def test_kernel_matches_reference(computed, qlens, heads, kv_heads, head_dim, block_size, window):
    cache, q, md, _, blocks = make_batch(computed, qlens, heads, kv_heads, head_dim, block_size)
    want = reference(cache, q, blocks, computed, qlens, window)
    got = cpu_kernel.paged_attention(q, cache, md, head_dim**-0.5, window)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 2e-5
    mask = torch_ref.build_mask(md, window, q.dtype)
    ref = torch_ref.paged_attention(q, cache, md, mask, head_dim**-0.5)
    assert (ref.double() - want).abs().max() < 2e-5


def both_backends_match(q, stored, values, md, blocks, computed, qlens, window) -> None:
    """Both backends over the cache `stored` against the reference over the `values` it holds:
    as close as with an fp32 cache."""
    heads, head_dim = q.shape[1:]
    want = reference(values, q, blocks, computed, qlens, window)
    assert cpu_kernel.supported(q, stored, heads, stored.shape[3], head_dim)
    got = cpu_kernel.paged_attention(q, stored, md, head_dim**-0.5, window)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 2e-5
    mask = torch_ref.build_mask(md, window, q.dtype)
    ref = torch_ref.paged_attention(q, stored, md, mask, head_dim**-0.5)
    assert ref.dtype == torch.float32 and (ref.double() - want).abs().max() < 2e-5


@pytest.mark.parametrize("computed,qlens,heads,kv_heads,head_dim,block_size,window",
                         [CASES[0], CASES[1], CASES[2], CASES[4], CASES[5]])
def test_fp16_cache_matches_reference(computed, qlens, heads, kv_heads, head_dim, block_size,
                                      window):
    """--kv-cache-dtype float16: K/V stored in fp16, attention still in fp32; one decode (CASES[0],
    [5]) runs a part a kv head, each converting its heads alone."""
    cache, q, md, _, blocks = make_batch(computed, qlens, heads, kv_heads, head_dim, block_size)
    half = cache.half()
    both_backends_match(q, half, half.float(), md, blocks, computed, qlens, window)


@pytest.mark.parametrize("computed,qlens,heads,kv_heads,head_dim,block_size,window",
                         [CASES[0], CASES[1], CASES[2], CASES[3], CASES[6]])
def test_int8_cache_matches_reference(computed, qlens, heads, kv_heads, head_dim, block_size,
                                      window):
    """--kv-cache-dtype int8: K/V stored as 8-bit groups of 32 with an fp32 scale and minimum,
    attention in fp32. The stored values are within half a step of the fp32 ones."""
    cache, q, md, _, blocks = make_batch(computed, qlens, heads, kv_heads, head_dim, block_size)
    rows = torch_ref.quantize_kv(cache)
    assert rows.dtype == torch.int8 and rows.shape[-1] == head_dim + head_dim // 4
    values = torch_ref.dequantize_kv(rows, head_dim)
    groups = cache.view(*cache.shape[:-1], -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 255
    assert ((values - cache).view(groups.shape).abs() <= step[..., None] * 0.5001 + 1e-6).all()
    both_backends_match(q, rows, values, md, blocks, computed, qlens, window)


def test_int8_cache_of_constants_and_extremes():
    """A constant group stores zeros, a zero scale and the constant as its minimum (exact); a
    group's least and greatest values map to 0 and 255, and come back exactly."""
    x = torch.zeros(2, 64)
    x[0, 32:] = 1.5
    x[1, :32] = torch.linspace(-3, 2, 32)
    rows = torch_ref.quantize_kv(x)
    params = rows[:, 64:].contiguous().view(torch.float32)  # [scale 0, scale 1, min 0, min 1]
    assert rows[0, :64].eq(0).all() and params[0].tolist() == [0.0, 0.0, 0.0, 1.5]
    q = rows[1, :32].view(torch.uint8)
    assert q[0] == 0 and q[31] == 255 and params[1, 2].item() == -3.0
    back = torch_ref.dequantize_kv(rows, 64)
    assert torch.equal(back[0], x[0]) and back[1, 0] == -3.0
    assert back[1, 31].item() == pytest.approx(2.0, abs=1e-6)


@pytest.mark.parametrize("case,kv", [(1, "float32"), (2, "float16"), (3, "int8"),
                                      (5, "float32")])
def test_soft_cap_matches_reference(case, kv):
    """Gemma 2's attention soft cap (scores s -> cap * tanh(s / cap) before the softmax) in
    the C kernel: the float64 definition's values and the torch backend's, over each cache
    type; with the scores well past the cap, so it changes the result. No cap (None) and a cap
    of 0 are the same call."""
    computed, qlens, heads, kv_heads, head_dim, block_size, window = CASES[case]
    cache, q, md, _, blocks = make_batch(computed, qlens, heads, kv_heads, head_dim, block_size)
    scale, cap = 0.5, 3.0  # scores of several times the cap
    if kv == "int8":
        stored = torch_ref.quantize_kv(cache)
        values = torch_ref.dequantize_kv(stored, head_dim)
    else:
        stored = cache.half() if kv == "float16" else cache
        values = stored.float()
    want = reference(values, q, blocks, computed, qlens, window, cap, scale)
    got = cpu_kernel.paged_attention(q, stored, md, scale, window, cap)
    assert (got.double() - want).abs().max() < 2e-5
    ref = torch_ref.paged_attention(q, stored, md, torch_ref.build_mask(md, window, q.dtype),
                                    scale, cap)
    assert (ref.double() - want).abs().max() < 2e-5
    uncapped = cpu_kernel.paged_attention(q, stored, md, scale, window)
    assert (uncapped.double() - want).abs().max() > 1e-2
    assert torch.equal(uncapped, cpu_kernel.paged_attention(q, stored, md, scale, window, 0.0))


def test_strided_query_view():
    """q as the model passes it: a view into a wider qkv row."""
    cache, q, md, _, _ = make_batch([10, 0], [1, 12], 9, 3, 64, 16)
    wide = torch.randn(q.shape[0], 12, 64)
    wide[:, :9] = q
    view = wide[:, :9]
    assert not view.is_contiguous()
    got = cpu_kernel.paged_attention(view, cache, md, 0.125, None)
    assert torch.equal(got, cpu_kernel.paged_attention(q, cache, md, 0.125, None))


@pytest.mark.parametrize("kv", ["float32", "float16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (8, 2, 128)])
def test_same_bits_alone_as_in_a_batch(kv, heads, kv_heads, head_dim):
    """A request's output does not depend on its neighbours (not so for a padded SDPA). A batch
    of 8 tiles runs whole tiles; alone, a request's one tile is cut across the threads, by kv
    head (one part a kv head) or, with fewer kv heads than threads, by query head (Gemma 3's
    one kv head: two parts of two heads): the same bits either way."""
    computed, qlens = [40, 0, 200, 7, 90, 1, 300, 64], [1, 30, 1, 3, 1, 1, 1, 1]
    cache, q, md, _, blocks = make_batch(computed, qlens, heads, kv_heads, head_dim, 16)
    cache = {"float32": cache, "float16": cache.half(), "int8": torch_ref.quantize_kv(cache)}[kv]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 8 tiles: whole; 1: cut in 3
    try:
        batch = cpu_kernel.paged_attention(q, cache, md, 0.125, None)
        starts = np.concatenate([[0], np.cumsum(qlens)])
        for r in range(len(qlens)):
            alone, _ = build_attention_metadata(
                [blocks[r]], [computed[r]], [qlens[r]], 16, torch.device("cpu")
            )
            sl = slice(starts[r], starts[r + 1])
            got = cpu_kernel.paged_attention(q[sl], cache, alone, 0.125, None)
            assert torch.equal(got, batch[sl]), r
    finally:
        torch.set_num_threads(threads)


def test_build_tiles():
    tiles = cpu_kernel.build_tiles(np.array([0, 1, 13]), 8)
    assert tiles.tolist() == [[0, 0, 1], [1, 1, 8], [1, 9, 4]]
    assert tiles.dtype == np.int64 and tiles.flags.c_contiguous
    assert cpu_kernel.tile_tokens(9, 3, 64) == 21 and cpu_kernel.tile_tokens(32, 32, 64) == 64
    assert cpu_kernel.tile_tokens(128, 1, 128) == 1


def test_supported_only_where_the_kernel_runs():
    cache = torch.zeros(2, 4, 16, 3, 64)
    q = torch.zeros(1, 9, 64)
    assert cpu_kernel.supported(q, cache, 9, 3, 64)
    assert not cpu_kernel.supported(q.bfloat16(), cache.bfloat16(), 9, 3, 64)
    assert not cpu_kernel.supported(q, cache, 9, 4, 64)


FIRST_USE = ("from loom.kernels import cpu_kernels; from loom.kernels.build import cache_dir; "
             "print(cpu_kernels() is not None, cache_dir())")
FRESH_CACHE = {"LOOM_CACHE_DIR": "{out}", "PATH": "/usr/bin:/bin"}


@pytest.mark.slow
@pytest.mark.background("first-use-build", [sys.executable, "-c", FIRST_USE], FRESH_CACHE)
def test_build_is_cached_and_switchable():
    """A fresh cache folder gets one library on first use (the variant this CPU runs best);
    LOOM_CPU_KERNELS=0 turns the kernels off. (The first use, a build of ~35 s on 2 cores, is
    a background job: tests/background.py.)"""
    on = background.result("first-use-build")
    assert on.stdout.split() == ["True", str(on.out / "kernels")], on.stderr
    assert len(list((on.out / "kernels").glob("loom_*.so"))) == 1
    env = {**FRESH_CACHE, "LOOM_CACHE_DIR": str(on.out), "LOOM_CPU_KERNELS": "0"}
    off = subprocess.run([sys.executable, "-c", FIRST_USE], env=env, capture_output=True,
                         text=True)
    assert off.stdout.split()[0] == "False", off.stderr
