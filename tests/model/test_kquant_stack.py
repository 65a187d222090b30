"""K-quant linears (KQuantLinear) inside the one-call C decoder stack (q8_decoder.py,
decoder_q8.c): a tiny GGUF whose fused linears mix Q4_K, Q5_K, Q6_K and int8-grid (Q8_0) parts,
as a llama-quantize Q4_K_M file does, runs on the stack with the module path's bits, with this
CPU's default kernels. (The real Gemma 3 270M file on the stack: tests/model/test_kquant.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from loom.kernels import cpu_kernels as get_kernels
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.models.q8_decoder import LINEAR_KQ, LINEAR_PARTS, LINEAR_Q8, LinearQ8, Q8Decoder
from loom.quant.int8 import Int8Linear
from loom.quant.kquant import KQuantLinear
from tests import gguf_files
from tests.cpu_kernels import require_cpu_kernels
from tests.model.test_arch_stack import _mixed_batch, _sampling_rows
from tests.model.test_kquant import random_blocks
from tests.tiny_models import make_tiny_model

# widths that are multiples of 256 (a K-quant super-block); head_dim 64
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def _kquant_gguf(tmp_path: Path, name: str, arch: str, overrides: dict[str, T],
                 head: T | None = None) -> Path:
    folder = make_tiny_model(name.split("-")[0], tmp_path / name, **SHAPE)
    real = gguf_files.quantize
    raw = None
    if head is not None:  # the embedding's and head's format (`overrides` name layers' tensors)
        from safetensors.torch import load_file

        hf = load_file(str(folder / "model.safetensors"))
        raw = {g: (real(hf[n].numpy(), head), head)
               for g, n in (("token_embd.weight", "model.embed_tokens.weight"),
                            ("output.weight", "lm_head.weight"))}

    def quantize(a: np.ndarray, qt: T) -> np.ndarray:
        if qt not in (T.Q4_K, T.Q5_K, T.Q6_K):
            return real(a, qt)
        # valid blocks of random bytes (the `gguf` package has no K-quant quantizer; the values
        # do not matter here, only that both paths read the same blocks)
        rng = np.random.default_rng(a.shape[0] * 7 + a.shape[1] + int(qt))
        return random_blocks(qt, *a.shape, rng).data.numpy()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_files, "quantize", quantize)
        return gguf_files.write_gguf(folder, tmp_path / f"{name}.gguf", arch, T.Q4_K,
                                     overrides=overrides, raw=raw)


# Llama: layer 0's qkv Q4_K + Q4_K + Q6_K, layer 1's Q4_K + Q4_K + Q8_0 (int8 grid); gate_up
# Q4_K + Q5_K; down Q6_K then Q4_K; the untied head Q4_K; the embedding Q4_K (expanded to fp32:
# looked up in Python). Qwen2: q/k/v biases beside an int8-grid v, a tied head.
CASES = {
    "llama": ("llama", {"1.attn_v": T.Q8_0, "attn_v": T.Q6_K, "ffn_up": T.Q5_K,
                        "0.ffn_down": T.Q6_K}),
    "qwen2": ("qwen2", {"attn_v": T.Q8_0, "ffn_down": T.Q6_K}),
}


def _kernels() -> list[str]:
    """The default build, and the AVX2 one where this CPU runs it (no bf16: K-quant steps past
    8 rows on the fp32 GEMM's team form)."""
    from loom.kernels import dispatch

    return ["auto"] + [v.name for v in dispatch.variants()
                       if v.name == "avx2" and dispatch.runs_here(v)]


@pytest.mark.slow
@pytest.mark.parametrize("name,kernels", [*((n, "auto") for n in CASES),
                                          *(("llama-kq-only", k) for k in _kernels()),
                                          *(("llama-kq-only-q8-head", k)
                                            for k in _kernels()[1:])])
def test_kquant_stack_matches_module_path(tmp_path, name, kernels) -> None:
    """The stack runs the K-quant model (mixed formats in one fused linear, one run after the
    other into their columns) with the default kernels, prompts and decode, and gives the
    module path's bits, in a mixed batch and on the sampling rows (the head in the C call).
    "llama-kq-only": no int8-grid part at all (a Q4_K_M file's usual make-up), on the default
    build and the AVX2 one (K-quant steps past 8 rows in the stack's one region on either);
    "-q8-head": its embedding and head on the int8 grid (Q8_0), on the AVX2 one (no bf16: a
    prompt's step whose head takes up to 8 rows runs in the one region too, the head on its
    decode kernel)."""
    require_cpu_kernels()
    kq_only, q8_head = name.startswith("llama-kq-only"), name.endswith("-q8-head")
    arch, overrides = CASES["llama" if kq_only else name]
    if kq_only:
        overrides = {k: v for k, v in overrides.items() if v != T.Q8_0}
    path = _kquant_gguf(tmp_path, name, arch, overrides, head=T.Q8_0 if q8_head else None)
    loaded = load_model(resolve_model(str(path)), "float32", cpu_kernels=kernels)
    layers = loaded.model.model.layers
    kinds = [[LinearQ8.of(p[k]).kind for k in ("qkv", "o", "gate_up", "down")]
             for p in (layer.stack_parts() for layer in layers)]
    assert kinds[0] == [LINEAR_PARTS, LINEAR_KQ, LINEAR_PARTS, LINEAR_KQ]
    qkv = LinearQ8.of(layers[1].stack_parts()["qkv"])
    assert [qkv.parts[i].kind for i in range(qkv.num_parts)] == (
        [LINEAR_KQ] * 3 if kq_only else [LINEAR_KQ, LINEAR_KQ, LINEAR_Q8])
    if name.startswith("llama"):
        assert layers[0].stack_parts()["qkv"].formats() == ["Q4_K", "Q4_K", "Q6_K"]
        # Q4_K parts interleaved 16 rows at a time where the build reads them (VNNI), so the
        # stack's team forms (and the GEMM past 8 rows) run them too
        q4 = [p for _, p in layers[0].stack_parts()["qkv"].parts.values()
              if p.qtype == T.Q4_K]
        assert all(p.interleaved for p in q4) == bool(
            loaded.kernels is not None and get_kernels().loom_kq_r16_available())
        assert isinstance(loaded.model.lm_head, Int8Linear if q8_head else KQuantLinear)
    else:
        assert layers[0].stack_parts()["qkv"].bias is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # decode in one OpenMP region needs a team, even on one core
    try:
        _, stack, _ = _mixed_batch(loaded, loaded.config.vocab_size)
        stack_rows = _sampling_rows(loaded)
        assert isinstance(loaded.model.model.stack, Q8Decoder), "the C stack did not run"
        if name.startswith("llama"):
            assert loaded.model.model.stack.head is not None  # the head in the call
        loaded.model.model.stack = False  # the per-module path, same weights and kernels
        _, module, _ = _mixed_batch(loaded, loaded.config.vocab_size)
        module_rows = _sampling_rows(loaded)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.isfinite(stack[r]).all() and torch.equal(stack[r], module[r])
               for r in stack)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(stack_rows, module_rows))


def test_replicas_keep_the_files_blocks(tmp_path, monkeypatch) -> None:
    """Data-parallel replicas (LOOM_HUGE_PAGES=tensors) share the GGUF file's pages, so their
    Q4_K parts stay as stored; a lone server interleaves them where the build reads them."""
    require_cpu_kernels()
    path = _kquant_gguf(tmp_path, "llama-replica", "llama", {})
    monkeypatch.setenv("LOOM_HUGE_PAGES", "tensors")
    loaded = load_model(resolve_model(str(path)), "float32")
    parts = [p for m in loaded.model.modules() if isinstance(m, KQuantLinear)
             for _, p in m.parts.values() if getattr(p, "qtype", None) == T.Q4_K]
    assert parts and not any(p.interleaved for p in parts)
    monkeypatch.delenv("LOOM_HUGE_PAGES")
    loaded = load_model(resolve_model(str(path)), "float32")
    parts = [p for m in loaded.model.modules() if isinstance(m, KQuantLinear)
             for _, p in m.parts.values() if getattr(p, "qtype", None) == T.Q4_K]
    assert all(p.interleaved for p in parts) == bool(get_kernels().loom_kq_r16_available())
