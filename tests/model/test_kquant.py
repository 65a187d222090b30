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

FORMATS = [GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
           GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> KBlocks:
    """Valid blocks of random bytes (every byte pattern is a valid K-quant block) with fp16
    scales of a trained model's size: d ~ 1e-3, dmin ~ 1e-3."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    halves = rng.uniform(2e-4, 2e-3, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        raw[:, 208:210] = halves[:, :2]
    elif qtype == GGMLQuantizationType.Q2_K:  # d, dmin at its end
        raw[:, 80:84] = halves
    elif qtype == GGMLQuantizationType.Q3_K:
        raw[:, 108:110] = halves[:, :2]
    else:
        raw[:, 0:4] = halves
    return KBlocks.from_gguf(raw.reshape(-1), qtype, (rows, cols))


def reference(blocks: KBlocks) -> np.ndarray:
    rows, cols = blocks.shape
    return dequantize(blocks.data.numpy().reshape(-1), blocks.qtype).reshape(rows, cols)


def bound(w: np.ndarray, x: np.ndarray, digits: int = 2) -> np.ndarray:
    """The kernel's error bound [M, N]: each x value within d / 256 of itself (d = max|x| / 127
    of its run of 16; d / 512 but where the second digit saturates), d / 2 with one digit, plus
    fp32 rounding."""
    m, k = x.shape
    d = np.abs(x.reshape(m, k // 16, 16)).max(-1) / 127  # [M, runs]
    err_x = np.repeat(d / (256 if digits == 2 else 2), 16, axis=1)  # [M, K]
    return err_x @ np.abs(w).T.astype(np.float64) + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30


ONE_DIGIT = 0x100  # loom.h's LOOM_KQ_ONE_DIGIT, or'ed into the format


def kq_linear(blocks: KBlocks, x: torch.Tensor, bias: torch.Tensor | None = None,
              threads: int = 2, flags: int = 0) -> torch.Tensor:
    rows, cols = blocks.shape
    y = torch.full((x.shape[0], rows), float("nan"))
    rc = cpu_kernels().loom_linear_kq(
        x.data_ptr(), x.shape[0], cols, x.stride(0), blocks.data.data_ptr(), blocks.fmt | flags,
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
    check_within_bound(random_blocks(qtype, 37, 768, rng), m, rng)


def check_within_bound(blocks: KBlocks, m: int, rng: np.random.Generator,
                       kernel_blocks: KBlocks | None = None) -> torch.Tensor:
    """`kernel_blocks` (default `blocks`: the same weights, maybe interleaved) against float64
    of `blocks`' dequantized weights, m rows of x with an outlier channel and a bias: within
    the two digits' bound, and a row's bits do not depend on the other rows of the call.
    Returns x."""
    n, k = blocks.shape
    kb = blocks if kernel_blocks is None else kernel_blocks
    w = reference(blocks).astype(np.float64)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 40  # an outlier
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    xt = torch.from_numpy(x)
    got = kq_linear(kb, xt, bias).double().numpy()
    want = x.astype(np.float64) @ w.T + bias.double().numpy()
    err = np.abs(got - want)
    assert (err <= bound(w, x)).all(), float((err / bound(w, x)).max())
    alone = kq_linear(kb, xt[-1:].contiguous(), bias)
    assert torch.equal(alone[0], torch.from_numpy(got[-1]).float())
    return xt


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_one_digit_within_its_bound(qtype) -> None:
    """LOOM_KQ_ONE_DIGIT (x in one digit a run: llama.cpp's activations with a scale a run of 16,
    not the default, see docs/kquants.md): within its d / 2 bound, above the two digits' error,
    a row's bits those of its batch."""
    require_cpu_kernels()
    rng = np.random.default_rng(11)
    blocks = random_blocks(qtype, 29, 512, rng)
    w = reference(blocks).astype(np.float64)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    x[:, 3] *= 40
    xt = torch.from_numpy(x)
    want = x.astype(np.float64) @ w.T
    for m in (1, 3, 8, 9):  # decode rows, and past 8 in chunks
        one = kq_linear(blocks, xt[:m], flags=ONE_DIGIT).double().numpy()
        assert (np.abs(one - want[:m]) <= bound(w, x[:m], digits=1)).all()
        assert torch.equal(kq_linear(blocks, xt[m - 1:m], flags=ONE_DIGIT)[0],
                           torch.from_numpy(one[-1]).float())
    two = kq_linear(blocks, xt).double().numpy()
    assert np.abs(two - want).max() < np.abs(one - want).max()
    y = torch.empty((1, 29))
    assert cpu_kernels().loom_linear_kq(  # an unknown flag bit is refused
        xt.data_ptr(), 1, 512, 512, blocks.data.data_ptr(), blocks.fmt | 0x400, None, 29,
        y.data_ptr(), 29, 1) == -1


def require_interleaved() -> None:
    """The interleaved Q4_K kernel is in the builds with AVX512-VNNI, and only there; the
    start-up line says so."""
    from loom.kernels import kernel_choice

    require_cpu_kernels()
    lib = cpu_kernels()
    assert bool(lib.loom_kq_r16_available()) == (lib.loom_kq_isa() == 4)
    choice = kernel_choice()
    assert ("Q4_K interleaved" in choice.describe()) == (
        bool(lib.loom_kq_r16_available()) and not choice.batch_invariant)
    if not lib.loom_kq_r16_available():
        pytest.skip("this build has no interleaved Q4_K kernel (AVX512-VNNI builds only)")


def test_interleaved_q4k_holds_the_same_weights() -> None:
    """Q4_K rows interleaved 16 at a time (KBlocks.interleave): the same bytes rearranged, each
    row's blocks back exactly, dequantized bit for bit; rows are not remapped afterwards."""
    require_interleaved()
    blocks = random_blocks(GGMLQuantizationType.Q4_K, 48, 768, np.random.default_rng(3))
    inter = blocks.interleave()
    assert inter.interleaved and inter.shape == blocks.shape
    assert not torch.equal(inter.data, blocks.data)
    back = torch.empty_like(blocks.data)
    for n in range(48):
        cpu_kernels().loom_kq_r16_row(inter.data.data_ptr(), 768, n, 0, 3,
                                      back[n].data_ptr())
    assert torch.equal(back, blocks.data)
    assert torch.equal(inter.dequantize(), torch.from_numpy(reference(blocks)))
    with pytest.raises(ValueError, match="16 at a time"):
        inter.map_rows(lambda t: t[:16])
    assert not random_blocks(GGMLQuantizationType.Q4_K, 40, 256,
                             np.random.default_rng(0)).can_interleave()  # 40 rows
    assert not random_blocks(GGMLQuantizationType.Q6_K, 32, 256,
                             np.random.default_rng(0)).can_interleave()


R16_INT_ROWS = 32  # loom.h's LOOM_KQ_R16_INT_ROWS


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 20, 32, 33])
def test_interleaved_q4k_kernel_within_bound_of_float64(m) -> None:
    """The interleaved kernel at 1..8 rows (decode) and past 8 (tiles of at most 8): within the
    two digits' bound, a row's bits those of the row alone; a bias is added. The GEMM entry
    runs it up to LOOM_KQ_R16_INT_ROWS rows, past them the GEMM, which reads the interleaved
    rows to the same bits as the stored ones."""
    require_interleaved()
    rng = np.random.default_rng(100 + m)
    n, k = 48, 768
    blocks = random_blocks(GGMLQuantizationType.Q4_K, n, k, rng)
    inter = blocks.interleave()
    xt = check_within_bound(blocks, m, rng, inter)
    layer = KQuantLinear(k, n, False)
    layer.load_rows(None, blocks)
    layer.batch_kernel = "gemm"  # any but "int": linear_kq_gemm.c past 8 rows
    stored = layer(xt)
    assert layer.interleave() == 1
    got_gemm = layer(xt)
    if m > R16_INT_ROWS:  # the GEMM's bits, interleaved or not
        assert torch.equal(got_gemm, stored)
    else:  # the integer kernel's
        assert not torch.equal(got_gemm, stored)
        assert torch.equal(got_gemm, kq_linear(inter, xt))


def test_interleaved_q4k_refusals() -> None:
    """A row count not a multiple of 16, one digit, or a format other than Q4_K: -1."""
    require_interleaved()
    lib = cpu_kernels()
    blocks = random_blocks(GGMLQuantizationType.Q4_K, 32, 256, np.random.default_rng(1))
    inter = blocks.interleave()
    x, y = torch.randn(1, 256), torch.empty(1, 32)
    args = (x.data_ptr(), 1, 256, 256, inter.data.data_ptr())
    assert lib.loom_linear_kq(*args, inter.fmt, None, 32, y.data_ptr(), 32, 1) == 0
    assert lib.loom_linear_kq(*args, inter.fmt, None, 24, y.data_ptr(), 32, 1) == -1
    assert lib.loom_linear_kq(*args, inter.fmt | ONE_DIGIT, None, 32, y.data_ptr(), 32, 1) == -1
    assert lib.loom_linear_kq(*args, 14 | 0x200, None, 32, y.data_ptr(), 32, 1) == -1
    assert lib.loom_kq_check(256, 14 | 0x200) == -1 and lib.loom_kq_check(256, inter.fmt) == 0


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K],
                         ids=lambda q: q.name)
def test_quantizer_for_benchmarks_writes_valid_blocks(qtype) -> None:
    """tests/kquant_quantize.py (bench_kquant_digits.py's Q4_K / Q6_K blocks of real weights):
    the `gguf` package reads them back near the weights (a relative RMS error of 4 / 6 bits),
    zero columns padded on as zeros, and the kernel runs them within its bound."""
    from tests.kquant_quantize import QUANTIZERS

    require_cpu_kernels()
    rng = np.random.default_rng(5)
    w = rng.standard_normal((24, 512)).astype(np.float32) * 0.05
    w[:, 416:] = 0.0  # padding (whole sub-blocks)
    w[2, 7] = 1.0  # an outlier
    raw = QUANTIZERS[qtype](w)
    blocks = KBlocks.from_gguf(raw.reshape(-1), qtype, w.shape)
    back = reference(blocks)
    rel = np.sqrt(((back - w) ** 2).mean() / (w**2).mean())
    assert rel < (0.1 if qtype == GGMLQuantizationType.Q4_K else 0.03), rel
    assert (back[:, 416:] == 0).all()
    x = rng.standard_normal((2, 512)).astype(np.float32)
    got = kq_linear(blocks, torch.from_numpy(x)).double().numpy()
    want = x.astype(np.float64) @ back.astype(np.float64).T
    assert (np.abs(got - want) <= bound(back.astype(np.float64), x)).all()


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


def test_each_build_runs_the_kquant_kernel_dispatch_names() -> None:
    """loom.kernels.dispatch names each build's K-quant kernel (the start-up line says it); the
    build this process loaded compiled that code path."""
    from loom.kernels import kernel_choice
    require_cpu_kernels()
    isa = {"vnni": 4, "avx512": 3, "avx2": 2, "neon": 1, "generic": 0}
    choice = kernel_choice()
    assert cpu_kernels().loom_kq_isa() == isa[choice.kquant]
    assert f"K-quant linears {choice.kquant}" in choice.describe()


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


@pytest.fixture(scope="module")
def gemma3_default():
    """The real Gemma 3 270M Q4_K_M GGUF loaded as `LLM()` does (the file's own blocks: its Q4_K
    and Q6_K linears on linear_kquant.c) and as the fp32 reference."""
    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from tests.gguf_files import gemma3_gguf_path

    require_cpu_kernels()
    source = resolve_model(str(gemma3_gguf_path()))
    return source, load_model(source, "float32"), load_model(source, "float32",
                                                             quantization="none")


@pytest.mark.slow
def test_gemma3_k_quants_stay_native_and_small(gemma3_default) -> None:
    """Every Q4_K / Q6_K linear keeps its blocks; the weights take about the file's bytes
    (the 32-wide Q8_0 ones sit on the int8 grid with fp32 scales: ~1.3 bytes a weight against
    the file's 1.06; the Q5_0 ones too on AVX2 / ARM builds, ~0.9 on AVX-512 ones at 5 bits,
    against the file's 0.69), where the fp32 default before took ~4.4x."""
    from loom.quant.kquant import KQuantLinear

    source, loaded, ref = gemma3_default
    assert loaded.quantization == "int8"
    kq = [m for m in loaded.model.modules() if isinstance(m, KQuantLinear)]
    assert len(kq) == 36  # 18 o_proj (Q4_K) + 18 down_proj (Q4_K or Q6_K)
    assert {f for m in kq for f in m.formats()} == {"Q4_K", "Q6_K"}

    def weight_bytes(model) -> int:  # the rotary tables (2 x 64 MiB) are not weights
        seen, total = set(), 0
        named = [*model.named_parameters(), *model.named_buffers()]
        for t in [t for name, t in named if "rotary" not in name]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total + sum(m.weight_bytes() for m in model.modules()
                           if isinstance(m, KQuantLinear))

    file_bytes = source.path.stat().st_size
    ours, before = weight_bytes(loaded.model), weight_bytes(ref.model)
    print(f"weights: file {file_bytes / 2**20:.0f} MiB, default {ours / 2**20:.0f} MiB, "
          f"fp32 {before / 2**20:.0f} MiB")
    assert ours < 1.45 * file_bytes
    assert before > 3 * ours


def reference_continuations(ref, prompts: dict[str, list[int]],
                            steps: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The reference's top-1 at each prompt position and along its own greedy continuation of
    `steps` tokens (fed back as it goes), and each request's tokens with that continuation."""
    from tests.paged_batch import PagedBatch

    gen = PagedBatch(ref, num_blocks=160)
    want = {k: v.argmax(-1) for k, v in gen.step(prompts).items()}  # prompt positions
    seqs = {k: list(p) for k, p in prompts.items()}
    for _ in range(steps - 1):
        for k in seqs:
            seqs[k].append(int(want[k][-1]))
        out = gen.step({k: [seqs[k][-1]] for k in seqs})
        want = {k: torch.cat([want[k], out[k].argmax(-1)]) for k in seqs}
    return want, seqs


def teacher_forced_top1(loaded, prompts: dict[str, list[int]], seqs: dict[str, list[int]],
                        steps: int, kv_dtype: torch.dtype | None = None
                        ) -> dict[str, torch.Tensor]:
    """`loaded`'s top-1 at the same positions, run as the engine runs them: the prompts in one
    step (more than 8 rows), then `seqs`' continuations a token a step in two groups of 8."""
    from tests.paged_batch import PagedBatch

    batch = PagedBatch(loaded, num_blocks=160, kv_dtype=kv_dtype)
    got = {k: v.argmax(-1) for k, v in batch.step(prompts).items()}
    keys = list(seqs)
    for t in range(steps - 1):
        for group in (keys[:8], keys[8:]):
            out = batch.step({k: [seqs[k][len(prompts[k]) + t]] for k in group})
            for k in group:
                got[k] = torch.cat([got[k], out[k].argmax(-1)])
    return got


@pytest.mark.slow
def test_gemma3_default_kernels_agree_with_reference(gemma3_default) -> None:
    """Issue 32's bar on the real Gemma 3 270M Q4_K_M file: teacher-forced top-1 agreement >= 99%
    between `LLM()`'s default kernels and the fp32 reference, over 16 chats and the reference's
    24-token greedy continuations, run as the engine runs them: the prompts in one step (more
    than 8 rows), then the continuations a token a step in two groups of 8 (decode). Measured on
    the Zen 4 (bf16 build): 1044 of 1047 with the default fp16 KV cache (1045 with an fp32 one;
    the int8 one, which the default leaves off for models with q/k norms: 1013 and 1027 in two
    runs), 1047 of 1047 batch-invariant."""
    from loom.tokenizer.tokenizer import Tokenizer
    from tests.model.test_engine import chats

    source, loaded, ref = gemma3_default
    tok = Tokenizer.from_source(source, loaded.config.eos_token_ids)
    prompts = {str(i): tok.encode_chat(c) for i, c in enumerate(chats())}
    want, seqs = reference_continuations(ref, prompts, 24)
    assert loaded.default_kv_cache_dtype() == torch.float16  # q/k norms (see its doc)
    got = teacher_forced_top1(loaded, prompts, seqs, 24, loaded.default_kv_cache_dtype())
    keys = list(seqs)
    agree = sum(int((got[k] == want[k]).sum()) for k in keys)
    total = sum(len(want[k]) for k in keys)
    print(f"Gemma 3 270M Q4_K_M default kernels {loaded.kernels}: top-1 {agree} / {total}")
    assert total > 800
    assert agree >= 0.99 * total, (agree, total)


@pytest.mark.slow
def test_gemma3_runs_on_the_c_stack_by_default(gemma3_default) -> None:
    """The default load runs on the one-call C stack (its Q4_K / Q6_K o and down projections
    as K-quant linears in the call), and its greedy tokens and logits are the module path's,
    prompts and decode, with the default kernels."""
    from loom.models.q8_decoder import Q8Decoder
    from tests.paged_batch import PagedBatch

    _, loaded, _ = gemma3_default
    model = loaded.model.model
    prompts = {"a": [2, 818, 5279, 529, 7001, 563], "b": [2, 2094, 9208, 236769, 236749, 1473],
               "c": [2, 4521, 3658, 496, 990]}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # decode in one OpenMP region needs a team, even on one core

    def greedy() -> tuple[dict[str, list[int]], list[torch.Tensor]]:
        batch, seqs, got = PagedBatch(loaded), {r: list(p) for r, p in prompts.items()}, []
        out = batch.step(prompts)
        for _ in range(6):
            got += [out[r] for r in sorted(out)]
            for r in seqs:
                seqs[r].append(int(out[r][-1].argmax()))
            out = batch.step({r: s[-1:] for r, s in seqs.items()})
        return seqs, got

    try:
        model.stack = None  # decided again on the first step
        stack_seqs, stack_logits = greedy()
        assert isinstance(model.stack, Q8Decoder), "the C stack did not run"
        model.stack = False  # the per-module path, same weights and kernels
        module_seqs, module_logits = greedy()
    finally:
        torch.set_num_threads(threads)
        model.stack = None
    assert stack_seqs == module_seqs
    assert all(torch.equal(a, b) for a, b in zip(stack_logits, module_logits))
