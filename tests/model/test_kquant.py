"""K-quant blocks kept native (loom.quant.kquant, csrc/linear_kquant.c): the kernels against a
float64 product of the `gguf` package's dequantized weights, on the build this process runs
(tests/unit/test_kernel_builds.py runs this file again on every build this CPU runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from loom.kernels import cpu_kernels
from loom.quant.int8 import Q8Groups
from loom.quant.kquant import KBlocks, KQuantLinear
from tests.cpu_kernels import require_cpu_kernels

FORMATS = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> KBlocks:
    """Valid blocks of random bytes (every byte pattern is a valid K-quant block) with fp16
    scales of a trained model's size: d ~ 1e-3, dmin ~ 1e-3."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    halves = rng.uniform(2e-4, 2e-3, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        raw[:, 208:210] = halves[:, :2]
    else:
        raw[:, 0:4] = halves
    return KBlocks.from_gguf(raw.reshape(-1), qtype, (rows, cols))


def reference(blocks: KBlocks) -> np.ndarray:
    rows, cols = blocks.shape
    return dequantize(blocks.data.numpy().reshape(-1), blocks.qtype).reshape(rows, cols)


def bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's error bound [M, N]: each x value within d / 256 of itself (d = max|x| / 127
    of its run of 16; d / 512 but where the second digit saturates), plus fp32 rounding."""
    m, k = x.shape
    d = np.abs(x.reshape(m, k // 16, 16)).max(-1) / 127  # [M, runs]
    err_x = np.repeat(d / 256, 16, axis=1)  # [M, K]
    return err_x @ np.abs(w).T.astype(np.float64) + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30


def kq_linear(blocks: KBlocks, x: torch.Tensor, bias: torch.Tensor | None = None,
              threads: int = 2) -> torch.Tensor:
    rows, cols = blocks.shape
    y = torch.full((x.shape[0], rows), float("nan"))
    rc = cpu_kernels().loom_linear_kq(
        x.data_ptr(), x.shape[0], cols, x.stride(0), blocks.data.data_ptr(), blocks.fmt,
        None if bias is None else bias.data_ptr(), rows, y.data_ptr(), rows, threads)
    assert rc == 0
    return y


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_dequant_matches_gguf_bit_for_bit(qtype) -> None:
    require_cpu_kernels()
    blocks = random_blocks(qtype, 5, 512, np.random.default_rng(0))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference(blocks)))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 20])
def test_kernel_within_bound_of_float64(qtype, m) -> None:
    """1..8 rows (decode) and more (chunks of 8 over blocks of weight rows), N not a multiple of
    anything, K a multiple of 256, x with an outlier channel."""
    require_cpu_kernels()
    rng = np.random.default_rng(m)
    n, k = 37, 768
    blocks = random_blocks(qtype, n, k, rng)
    w = reference(blocks).astype(np.float64)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 40  # an outlier
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    xt = torch.from_numpy(x)
    got = kq_linear(blocks, xt, bias).double().numpy()
    want = x.astype(np.float64) @ w.T + bias.double().numpy()
    err = np.abs(got - want)
    assert (err <= bound(w, x)).all(), float((err / bound(w, x)).max())
    # a row's bits do not depend on the other rows of the call
    alone = kq_linear(blocks, xt[-1:].contiguous(), bias)
    assert torch.equal(alone[0], torch.from_numpy(got[-1]).float())


def test_rows_with_a_stride_and_one_thread() -> None:
    require_cpu_kernels()
    rng = np.random.default_rng(7)
    blocks = random_blocks(GGMLQuantizationType.Q4_K, 19, 256, rng)
    wide = torch.from_numpy(rng.standard_normal((3, 300)).astype(np.float32))
    x = wide[:, :256]  # rows 300 floats apart
    got = kq_linear(blocks, x, threads=1)
    assert torch.equal(got, kq_linear(blocks, x.contiguous(), threads=2))


def test_bad_shapes_are_refused() -> None:
    require_cpu_kernels()
    lib = cpu_kernels()
    x, y = torch.zeros(1, 300), torch.zeros(1, 4)
    w = torch.zeros(4, 200, dtype=torch.uint8)
    assert lib.loom_linear_kq(x.data_ptr(), 1, 300, 300, w.data_ptr(), 12, None, 4,
                              y.data_ptr(), 4, 1) == -1  # K not a multiple of 256
    assert lib.loom_linear_kq(x.data_ptr(), 1, 256, 300, w.data_ptr(), 2, None, 4,
                              y.data_ptr(), 4, 1) == -1  # not a K-quant


def test_fused_linear_keeps_each_parts_format() -> None:
    """A qkv-like layer of Q4_K, Q6_K and an int8-grid (Q8_0-like) part, with a bias: the same
    as the float64 product of the parts' values."""
    require_cpu_kernels()
    rng = np.random.default_rng(3)
    k = 512
    q = random_blocks(GGMLQuantizationType.Q4_K, 24, k, rng)
    kk = random_blocks(GGMLQuantizationType.Q6_K, 8, k, rng)
    v = Q8Groups(torch.from_numpy(rng.integers(0, 256, (8, k), dtype=np.uint8)),
                 torch.full((8, k // 32), 1e-3), torch.full((8, k // 32), -0.1))
    layer = KQuantLinear(k, 40, bias=True)
    layer.bias.data.copy_(torch.arange(40, dtype=torch.float32))
    for rows, part in ((slice(0, 24), q), (slice(24, 32), kk), (slice(32, 40), v)):
        assert layer.load_rows(rows, part) == rows.stop - rows.start
    assert layer.formats() == ["Q4_K", "Q6_K", "int8 grid (8-bit)"]
    w = np.concatenate([reference(q), reference(kk), v.dequantize().numpy()]).astype(np.float64)
    x = rng.standard_normal((3, k)).astype(np.float32)
    got = layer(torch.from_numpy(x)).double().numpy()
    want = x.astype(np.float64) @ w.T + np.arange(40)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    with pytest.raises(ValueError, match="shape"):
        layer.load_rows(slice(0, 24), kk)
