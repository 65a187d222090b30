"""INT4 weight-only linears from GPTQ and AWQ layouts (loom/quant/gptq.py) and the Triton
dequant-GEMM (loom/quant/int4_triton.py), run in Triton's interpreter on the CPU against
dequantize-then-matmul. The packed tensors are built here from the formats' definitions, one
nibble at a time, independently of the unpacking code under test."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from loom.quant.gptq import (  # noqa: E402
    AWQ_ORDER, Int4GptqLinear, dequantize, from_awq, from_gptq, int4_matmul,
)

K, N, GROUP = 256, 80, 128
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> [...] int32 words, nibble j in bits 4j..4j+3."""
    v = (nibbles.long() << (4 * torch.arange(8))).sum(-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def reference_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // GROUP, N), generator=g)
    s = (torch.rand(K // GROUP, N, generator=g) * 0.02 + 0.005).half()
    w = (q - z.repeat_interleave(GROUP, 0)).float() * s.float().repeat_interleave(GROUP, 0)
    return q, z, s, w


def pack_gptq(q, z):
    """qweight: 8 consecutive input rows a word; qzeros: zero - 1 (GPTQ's convention), 8
    consecutive columns a word."""
    k, n = q.shape
    qweight = _words(q.reshape(k // 8, 8, n).transpose(1, 2))  # [K/8, N]
    qzeros = _words(((z - 1) & 0xF).reshape(z.shape[0], n // 8, 8))  # [G, N/8]
    return qweight, qzeros


def pack_awq(q, z):
    """Both packed along columns, nibble j holding column AWQ_ORDER[j] of its eight."""
    order = torch.tensor(AWQ_ORDER)

    def cols(m):
        return _words(m.reshape(m.shape[0], -1, 8)[..., order])
    return cols(q), cols(z)


def test_layouts_dequantize_exactly() -> None:
    q, z, s, w = reference_weights(0)
    z = z.clamp(min=1)  # GPTQ's zero - 1 must stay a nibble
    w = (q - z.repeat_interleave(GROUP, 0)).float() * s.float().repeat_interleave(GROUP, 0)
    for canon in (from_gptq(*pack_gptq(q, z), s, torch.arange(K) // GROUP),
                  from_awq(*pack_awq(q, z), s)):
        assert torch.equal(dequantize(*canon, torch.float32), w)
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(*pack_gptq(q, z), s, torch.arange(K).flip(0) // GROUP)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_gemm_matches_dequantize_then_matmul(dtype, tol) -> None:
    q, z, s, w = reference_weights(1)
    canon = from_awq(*pack_awq(q, z), s)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = int4_matmul(x, *canon)  # 5 rows, 80 columns: both edges masked
    want = x.float() @ w
    assert got.dtype == dtype and got.shape == (5, N)
    assert ((got.float() - want).norm() / want.norm()).item() < tol


@needs_triton
def test_linear_module_kernel_and_fallback_agree(monkeypatch) -> None:
    q, z, s, _ = reference_weights(3)
    layer = Int4GptqLinear(*from_awq(*pack_awq(q, z), s), bias=torch.randn(N))
    x = torch.randn(2, 3, K)
    kernel = layer(x)
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU's dequantize fallback
    fallback = layer(x)
    assert kernel.shape == (2, 3, N)
    assert torch.allclose(kernel, fallback, rtol=1e-4, atol=1e-4)


def quantize(w: torch.Tensor):
    """An nn.Linear weight [N, K] -> (q [K, N], zeros [G, N] in 1..15, fp16 scales [G, N],
    the dequantized weight [N, K])."""
    wt = w.t().reshape(-1, GROUP, w.shape[0])  # [G, 128, N]
    lo, hi = wt.amin(1), wt.amax(1)
    s = ((hi - lo) / 15).clamp(min=1e-4).half()
    z = torch.round(-lo / s.float()).clamp(1, 15)
    q = torch.round(wt / s.float()[:, None] + z[:, None]).clamp(0, 15)
    deq = ((q - z[:, None]) * s.float()[:, None]).reshape(-1, w.shape[0])
    return q.reshape(-1, w.shape[0]).long(), z.long(), s, deq.t().contiguous()


@needs_triton
@pytest.mark.parametrize("method", ["gptq"])  # AWQ differs in from_awq alone (tested above)
def test_checkpoint_loads_and_matches_its_dequantized_weights(tmp_path, method) -> None:
    """A tiny Llama whose decoder linears are stored as GPTQ / AWQ INT4 loads into
    Int4GptqLinear (q/k/v and gate/up packed together) and gives the logits of the same model
    with the dequantized weights stored as floats; its linears run the Triton GEMM (here in
    the interpreter)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from tests.paged_batch import PagedBatch, rel_err
    from tests.tiny_models import make_tiny_model

    src = make_tiny_model("llama", tmp_path / "src", hidden_size=128, intermediate_size=256,
                          head_dim=32)
    state = load_file(str(src / "model.safetensors"))
    quant, floats = dict(state), dict(state)
    for name, w in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, z, s, deq = quantize(w)
            base = name[: -len(".weight")]
            qweight, qzeros = (pack_gptq if method == "gptq" else pack_awq)(q, z)
            del quant[name]
            quant.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros,
                          f"{base}.scales": s})
            floats[name] = deq
    folders = {}
    for kind, tensors in (("int4", quant), ("float", floats)):
        folder = folders[kind] = tmp_path / kind
        shutil.copytree(src, folder)
        save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folders["int4"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128,
                                     "desc_act": False, "version": "gemm"}
    (folders["int4"] / "config.json").write_text(json.dumps(config))

    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = {}
    for kind, folder in folders.items():
        loaded = load_model(resolve_model(str(folder)), "float32", "cpu")
        logits[kind] = PagedBatch(loaded).step({"r": ids})["r"]
        if kind == "int4":
            assert loaded.quantization == method
            int4 = [m for m in loaded.model.modules() if isinstance(m, Int4GptqLinear)]
            assert len(int4) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert rel_err(logits["int4"], logits["float"]) < 1e-4
