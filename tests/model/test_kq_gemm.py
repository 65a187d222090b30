"""K-quant linears past 8 rows (csrc/linear_kq_gemm.c): panels of weight rows unpacked once a
call (bf16 with AVX512-BF16, int16 with AVX2, else fp32) against all rows, on the build this
process runs (tests/unit/test_kernel_builds.py runs this file again on every build this CPU
runs). The kernel's float64 reference: the `gguf` package's dequantized weights, rounded to bf16
with x in the bf16 build (its precision), as they are in the others, with x rounded to one int16
a super-block in the int16 build (as it rounds); the only error left is fp32 summation's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from loom.kernels import cpu_kernels, kernel_choice
from loom.quant.int8 import Q8Groups
from loom.quant.kquant import KBlocks, KQuantLinear
from tests.cpu_kernels import require_cpu_kernels
from tests.model.test_kquant import FORMATS, ONE_DIGIT, kq_linear, random_blocks, reference


def gemm(blocks: KBlocks, x: torch.Tensor, bias: torch.Tensor | None = None, threads: int = 2,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """loom_linear_kq_gemm of x's rows (x.stride(0) apart) into out (NaN-filled where None)."""
    rows, cols = blocks.shape
    y = torch.full((x.shape[0], rows), float("nan")) if out is None else out
    rc = cpu_kernels().loom_linear_kq_gemm(
        x.data_ptr(), x.shape[0], cols, x.stride(0), blocks.data.data_ptr(), blocks.fmt,
        None if bias is None else bias.data_ptr(), rows, y.data_ptr(), y.stride(0), threads)
    assert rc == 0
    return y


def q2_grid_step(blocks: KBlocks) -> np.ndarray:
    """[rows, super-blocks]: the step D = B / 4095 the int16 build rounds a Q2_K super-block's
    weights to (B: the largest |w| its runs' scales and minimums allow, at q = 0 or 3)."""
    raw = blocks.data.numpy().reshape(-1, 84)
    d = raw[:, 80:82].copy().view(np.float16).astype(np.float64)
    dmin = raw[:, 82:84].copy().view(np.float16).astype(np.float64)
    sw, ow = d * (raw[:, :16] & 15), dmin * (raw[:, :16] >> 4)
    bound = np.maximum(np.abs(ow), np.abs(3 * sw - ow)).max(-1)
    return (bound / 4095).reshape(blocks.shape[0], -1)


def want(w: np.ndarray, x: np.ndarray, step: np.ndarray | None = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """(the float64 product the build's kernel computes, its bound: fp32 summation's, and where
    the int16 build rounds weights to a grid of `step` a super-block, half a step a weight)."""
    isa = cpu_kernels().loom_kq_gemm_isa()
    grid = 0.0
    if isa == 1 and step is not None:
        grid = np.abs(x.astype(np.float64)) @ np.repeat(0.5 * step, 256, axis=1).T * 1.001
    if isa == 2:  # bf16 panels and x
        w = torch.from_numpy(w.astype(np.float32)).bfloat16().double().numpy()
        x = torch.from_numpy(x).bfloat16().double().numpy()
    if isa == 1:  # x as X dx, X = x / dx in int16 a super-block, dx = max |x| / 32767 (fp32)
        g = x.astype(np.float32).reshape(x.shape[0], -1, 256)
        amax = np.abs(g).max(-1, keepdims=True)
        inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), np.float32(0))
        X = np.rint(g * inv.astype(np.float32))
        assert np.abs(X).max() <= 32767
        x = (X.astype(np.float64) * (amax / np.float32(32767)).astype(np.float64)).reshape(x.shape)
    x, w = x.astype(np.float64), w.astype(np.float64)
    return x @ w.T, 1e-5 * (np.abs(x) @ np.abs(w).T) + grid + 1e-30


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [9, 17, 64, 130])
def test_gemm_matches_float64(qtype, m) -> None:
    """N odd, K three super-blocks (and, at 17 rows, 2304: more than one panel chunk of
    columns), x with an outlier channel, a bias; a row's bits do not depend on the other rows
    of its call."""
    require_cpu_kernels()
    rng = np.random.default_rng(m)
    n, k = (21, 2304) if m == 17 else (37, 768)
    blocks = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 40
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    got = gemm(blocks, torch.from_numpy(x), bias)
    step = q2_grid_step(blocks) if qtype == GGMLQuantizationType.Q2_K else None
    product, tol = want(reference(blocks), x, step)
    err = np.abs(got.double().numpy() - bias.double().numpy() - product)
    assert (err <= tol + 1e-6 * np.abs(bias.numpy())).all(), float((err / tol).max())
    tail = torch.from_numpy(x[-9:].copy())  # the last 9 rows alone, in other tiles
    assert torch.equal(gemm(blocks, tail, bias), got[-9:])


def test_gemm_strides_threads_and_up_to_8_rows() -> None:
    """x rows and y rows wider than K and N, one thread or two: the same bits; up to 8 rows it
    is linear_kquant.c's kernel itself; bad K or format refused (LOOM_KQ_ONE_DIGIT too: the
    integer kernel's alone)."""
    require_cpu_kernels()
    rng = np.random.default_rng(5)
    blocks = random_blocks(GGMLQuantizationType.Q4_K, 19, 512, rng)
    wide = torch.from_numpy(rng.standard_normal((12, 600)).astype(np.float32))
    x = wide[:, :512]
    out = torch.full((12, 30), -1.0)
    gemm(blocks, x, threads=1, out=out[:, :19])
    assert (out[:, 19:] == -1).all()
    assert torch.equal(out[:, :19], gemm(blocks, x.contiguous(), threads=2))
    assert torch.equal(gemm(blocks, x[:8]), kq_linear(blocks, x[:8]))
    lib, y = cpu_kernels(), torch.zeros(12, 4)
    w = torch.zeros(4, 200, dtype=torch.uint8)
    for k, fmt, m in ((300, 12, 12), (256, 2, 12), (256, 12 | ONE_DIGIT, 12),
                      (256, 12 | ONE_DIGIT, 1)):  # K not a multiple of 256; not a K-quant
        assert lib.loom_linear_kq_gemm(wide.data_ptr(), m, k, 600, w.data_ptr(), fmt, None, 4,
                                       y.data_ptr(), 4, 1) == -1


def test_fused_linear_past_8_rows() -> None:
    """KQuantLinear of Q4_K, Q6_K, Q5_K and an int8-grid part with a bias, 17 rows on the
    build's default kernel past 8 rows; `batch_kernel` "int" is linear_kquant.c's bits."""
    require_cpu_kernels()
    rng = np.random.default_rng(11)
    k = 512
    parts = [random_blocks(GGMLQuantizationType.Q4_K, 24, k, rng),
             random_blocks(GGMLQuantizationType.Q6_K, 8, k, rng),
             random_blocks(GGMLQuantizationType.Q5_K, 5, k, rng),
             Q8Groups(torch.from_numpy(rng.integers(0, 256, (8, k), dtype=np.uint8)),
                      torch.full((8, k // 32), 1e-3), torch.full((8, k // 32), -0.1))]
    layer = KQuantLinear(k, 45, bias=True)
    layer.bias.data.copy_(torch.arange(45, dtype=torch.float32))
    start = 0
    for p in parts:
        start += layer.load_rows(slice(start, start + p.shape[0]), p)
    x = torch.from_numpy(rng.standard_normal((17, k)).astype(np.float32))
    layer.batch_kernel = kernel_choice().kquant_batch
    got = layer(x).double().numpy()
    w = np.concatenate([reference(p) for p in parts[:3]] + [parts[3].dequantize().numpy()])
    exact = x.double().numpy() @ w.astype(np.float64).T + np.arange(45)
    assert np.abs(got - exact).max() < 1e-2 * np.abs(exact).max()
    layer.batch_kernel = "int"
    assert torch.equal(layer(x)[:, :24], kq_linear(parts[0], x) + layer.bias[:24])


def test_dispatch_names_the_kernel_past_8_rows() -> None:
    """The start-up line names it; --batch-invariant keeps the integer kernel at every size;
    the build loaded runs the code dispatch names."""
    from loom.kernels.dispatch import choose, variant

    require_cpu_kernels()
    choice = kernel_choice()
    isa = {"bf16": 2, "int16": 1, "fp32": 0, "int": (0, 1, 2)}[
        variant(choice.variant).kquant_batch]
    assert cpu_kernels().loom_kq_gemm_isa() in np.atleast_1d(isa)
    name = choice.kquant if choice.kquant_batch == "int" else choice.kquant_batch
    assert f"K-quant linears {choice.kquant} up to 8 rows, {name} past 8" in choice.describe()
    still = choose(choice.variant, batch_invariant=True)
    assert still.kquant_batch == "int"
    assert f"{still.kquant} up to 8 rows, {still.kquant} past 8" in still.describe()


@pytest.mark.slow
def test_stack_runs_it_as_the_module_path_does(tmp_path) -> None:
    """A tiny K-quant GGUF (mixed formats in fused linears) loaded with the defaults: every
    K-quant linear runs the dispatch's kernel past 8 rows, the one-call C stack takes it too
    (its KQ_GEMM flag) and gives the module path's bits over prompts of 11 to 25 rows and
    decode; loaded batch-invariant, the integer kernel at every size, the flag off."""
    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from loom.models.q8_decoder import KQ_GEMM, Q8Decoder
    from tests.model.test_arch_stack import _mixed_batch
    from tests.model.test_kquant_stack import CASES, _kquant_gguf

    require_cpu_kernels()
    arch, overrides = CASES["llama"]
    source = resolve_model(str(_kquant_gguf(tmp_path, "llama", arch, overrides)))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for invariant in (False, True):
            loaded = load_model(source, "float32", batch_invariant=invariant)
            kernel = loaded.kernels.kquant_batch
            assert kernel == "int" or not invariant
            kq = [m for m in loaded.model.modules() if isinstance(m, KQuantLinear)]
            assert kq and {m.batch_kernel for m in kq} == {kernel}
            _, stack, _ = _mixed_batch(loaded, loaded.config.vocab_size)
            decoder = loaded.model.model.stack
            assert isinstance(decoder, Q8Decoder), "the C stack did not run"
            assert bool(decoder.code & KQ_GEMM) == (kernel != "int")
            loaded.model.model.stack = False
            _, module, _ = _mixed_batch(loaded, loaded.config.vocab_size)
            assert all(torch.isfinite(stack[r]).all() and torch.equal(stack[r], module[r])
                       for r in stack)
    finally:
        torch.set_num_threads(threads)
