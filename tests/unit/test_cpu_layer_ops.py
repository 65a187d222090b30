"""The fused C layer ops against the torch ops they replace, below and above the token count
where they go parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.attention.backends import torch_ref
from loom.kernels import cpu_ops
from loom.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from tests.cpu_kernels import require_cpu_kernels


@pytest.fixture(autouse=True)
def _kernels() -> None:
    require_cpu_kernels()


@pytest.mark.parametrize("n", [1, 5, 40])
def test_add_rms_norm(n):
    g = torch.Generator().manual_seed(n)
    x, res, w = torch.randn(n, 576, generator=g), torch.randn(n, 576, generator=g), torch.randn(576, generator=g)
    want_res = res + x
    want = F.rms_norm(want_res, (576,), w, 1e-5)
    x2, res2 = x.clone(), res.clone()
    cpu_ops.add_rms_norm_(x2, res2, w, 1e-5)
    assert torch.equal(res2, want_res)
    torch.testing.assert_close(x2, want, rtol=1e-5, atol=1e-5)
    x3 = x.clone()
    cpu_ops.add_rms_norm_(x3, None, w, 1e-5)  # no residual: plain norm
    torch.testing.assert_close(x3, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 49152), (32, 49152), (3, 7), (5, 16), (4, 33), (2, 1001)])
def test_argmax_rows_is_torch_max_indices(rows, n):
    """The sampler's greedy pick: torch's max(dim=-1).indices, ties, infinities, NaN and strided
    rows included (16 lanes, then a tail, then across lanes)."""
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g)
    x[0, n // 2] = x[0, n - 1] = x[0].max() + 1  # a tie: the first wins
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2, n // 3], x[2, 0] = float("nan"), float("inf")  # NaN beats everything
    if rows > 3:
        x[3, n - 1] = float("nan")  # in the tail
    assert torch.equal(cpu_ops.argmax_rows(x), x.max(dim=-1).indices)
    wide = torch.randn(rows, n + 5, generator=g)[:, :n]  # rows n + 5 floats apart
    assert torch.equal(cpu_ops.argmax_rows(wide), wide.max(dim=-1).indices)


@pytest.mark.parametrize("n,d", [(1, 1536), (40, 1536), (3, 37)])
def test_silu_mul(n, d):
    """Against torch, rows of every width (a last partial vector), gates far out both ways:
    no NaN or infinity where e^-g overflows."""
    gu = torch.randn(n, 2 * d, generator=torch.Generator().manual_seed(0)) * 4
    gu[0, :7] = torch.tensor([-1000.0, -100.0, -88.5, -87.0, 0.0, 88.5, 1000.0])
    gate, up = gu.chunk(2, dim=-1)
    got = cpu_ops.silu_mul(gu)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [(1, 9, 3, 64), (40, 4, 4, 128), (17, 8, 1, 32)])
def test_rope_write_kv(n, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(n)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    rotary.build_cache(torch.device("cpu"))
    positions = torch.randperm(512, generator=g)[:n]
    slots = torch.randperm(8 * 16, generator=g)[:n]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    # torch: rotate q and k, write k and v
    rope = Rope(rotary, positions, fused=False)
    qk = apply_rotary(qkv[:, :k_end].view(n, heads + kv_heads, head_dim), *rope.cos_sin())
    want_cache = torch.zeros(2, 8, 16, kv_heads, head_dim)
    torch_ref.write_kv(want_cache, qk[:, heads:], qkv[:, k_end:].view(n, kv_heads, head_dim), slots)
    # kernel, on a strided view as the model passes it (rows of a wider buffer)
    wide = torch.zeros(n, qkv.shape[1] + 7)
    wide[:, : qkv.shape[1]] = qkv
    view = wide[:, : qkv.shape[1]]
    cache = torch.zeros(2, 8, 16, kv_heads, head_dim)
    cpu_ops.rope_write_kv_(view, heads, kv_heads, head_dim, rotary.cos_sin_cache, positions, slots, cache)
    torch.testing.assert_close(view[:, :q_end].view(n, heads, head_dim), qk[:, :heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)
    assert torch.equal(view[:, k_end:], qkv[:, k_end:])  # v untouched
    assert torch.equal(wide[:, qkv.shape[1]:], torch.zeros(n, 7))  # nothing past the view
    # an fp16 cache (--kv-cache-dtype float16) takes the same K/V rounded to nearest
    half = torch.zeros(2, 8, 16, kv_heads, head_dim, dtype=torch.float16)
    cpu_ops.rope_write_kv_(qkv.clone(), heads, kv_heads, head_dim, rotary.cos_sin_cache,
                           positions, slots, half)
    assert torch.equal(half, cache.half())
    # an int8 cache (--kv-cache-dtype int8) takes the same bytes as torch_ref's quantizer
    if head_dim % 32 == 0:
        rows = torch.zeros(2, 8, 16, kv_heads, head_dim + head_dim // 4, dtype=torch.int8)
        cpu_ops.rope_write_kv_(qkv.clone(), heads, kv_heads, head_dim, rotary.cos_sin_cache,
                               positions, slots, rows)
        assert torch.equal(rows, torch_ref.quantize_kv(cache))


def test_rope_rejects_positions_past_the_table():
    rotary = RotaryEmbedding(64, 32, 10000.0, None)
    rotary.build_cache(torch.device("cpu"))
    with pytest.raises(IndexError, match="past the rotary table"):
        Rope(rotary, torch.tensor([3, 32]), fused=True)


def test_usable():
    assert cpu_ops.usable(torch.zeros(2, 3))
    assert not cpu_ops.usable(torch.zeros(2, 3, dtype=torch.bfloat16))
