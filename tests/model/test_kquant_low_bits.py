"""Q2_K and Q3_K tensors (Q2_K and Q3_K_M files) run on the K-quant kernels as the file stores
them, and a file of either keeps its blocks by default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from loom.quant.kquant import KBlocks, native
from tests.cpu_kernels import require_cpu_kernels
from tests.model.test_kquant import bound, kq_linear, random_blocks


def _q3_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q3_K blocks (every byte pattern is one) with a trained model's fp16 d."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[T.Q3_K]
    raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    d = rng.uniform(2e-4, 2e-3, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])
    raw[:, 108:110] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def test_q3_k_is_held_as_stored() -> None:
    raw = _q3_k(6, 768, 0)
    assert native(T.Q3_K, (6, 768)) and not native(T.Q3_K, (6, 96)) and native(T.Q2_K, (6, 768))
    blocks = KBlocks.from_gguf(raw, T.Q3_K, (6, 768))
    assert blocks.qtype == T.Q3_K and blocks.data.shape == (6, 3 * 110)
    assert np.array_equal(blocks.data.numpy(), raw)
    require_cpu_kernels()
    want = dequantize(raw, T.Q3_K).reshape(6, 768)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(want))


def test_q3_k_products_with_negative_scales_within_the_kernels_bound() -> None:
    """d of either sign (test_kquant.py's blocks have d > 0), decode rows and past 8."""
    require_cpu_kernels()
    rng = np.random.default_rng(3)
    raw = _q3_k(37, 512, 1)
    blocks = KBlocks.from_gguf(raw, T.Q3_K, (37, 512))
    w = dequantize(raw, T.Q3_K).reshape(37, 512).astype(np.float64)
    for m in (1, 5, 12):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        got = kq_linear(blocks, torch.from_numpy(x)).double().numpy()
        err = np.abs(got - x.astype(np.float64) @ w.T)
        assert (err <= bound(w, x)).all()


def _q2_k(rows: int, cols: int, seed: int) -> np.ndarray:
    return random_blocks(T.Q2_K, rows, cols, np.random.default_rng(seed)).data.numpy()


@pytest.mark.parametrize("qtype", [T.Q3_K, T.Q2_K], ids=lambda q: q.name)
def test_a_low_bit_k_quant_file_keeps_its_blocks(tmp_path, monkeypatch, qtype) -> None:
    """A GGUF with Q3_K (Q2_K) attention and MLP tensors (as a Q3_K_M or Q2_K file has them)
    keeps them in blocks by default, not in fp32: the logits of its values dequantized, over a
    prompt."""
    from gguf.quants import quantize

    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from loom.quant.kquant import KQuantLinear
    from tests import gguf_files
    from tests.paged_batch import PagedBatch, rel_err
    from tests.tiny_models import make_tiny_model

    require_cpu_kernels()

    def fake_quantize(a: np.ndarray, qt: T) -> np.ndarray:  # gguf has no Q2_K / Q3_K quantizer
        if qt != qtype:
            return quantize(a, qt)
        rows = int(np.prod(a.shape[:-1]))
        return {T.Q3_K: _q3_k, T.Q2_K: _q2_k}[qt](rows, a.shape[-1], rows).reshape(
            *a.shape[:-1], -1)

    folder = make_tiny_model("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512,
                             head_dim=64)
    monkeypatch.setattr(gguf_files, "quantize", fake_quantize)
    path = gguf_files.write_gguf(folder, tmp_path / "q3.gguf", "llama", T.Q8_0,
                                 overrides={"attn_q": qtype, "ffn_up": qtype,
                                            "ffn_down": qtype})
    loaded = load_model(resolve_model(str(path)), "float32", batch_invariant=True)
    assert loaded.quantization == "int8"
    mlp = loaded.model.model.layers[0].mlp
    assert isinstance(mlp.down_proj, KQuantLinear) and mlp.down_proj.formats() == [qtype.name]
    reference = load_model(resolve_model(str(path)), "float32", quantization="none")
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = PagedBatch(loaded).step({"r": ids})["r"]
    theirs = PagedBatch(reference).step({"r": ids})["r"]
    assert rel_err(ours, theirs) < 1e-2  # 8-bit activations
    # the default kernels too: past 8 rows the GEMM (AVX2: Q2_K's weights on a 13-bit grid)
    default = load_model(resolve_model(str(path)), "float32")
    assert rel_err(PagedBatch(default).step({"r": ids})["r"], theirs) < 1e-2
