"""GGUF mixtures of experts keep their experts quantized: a tiny GGUF per family whose
[experts, rows, cols] expert tensors are in Q4_0 / Q4_1 / Q5_0 / Q8_0 (Loom's int8 grid) or
Q4_K / Q5_K / Q6_K (K-quant blocks as stored) loads each expert as a Loom linear in that form,
never in fp32, and in one mixed paged batch gives transformers' logits (on the same weights,
dequantized) to tolerance and its greedy tokens, and Loom's fp32 reference's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import save_file

from loom.loader import gguf as gguf_loader
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.models.moe import SparseMoeBlock
from loom.layers.router import RouterLinear
from loom.quant.int8 import Q5, Int8Linear
from loom.quant.kquant import KQuantLinear
from tests import gguf_files
from tests.cpu_kernels import require_cpu_kernels
from tests.model.test_arch_stack import _mixed_batch, match_transformers, transformers_model
from tests.model.test_kquant import random_blocks
from tests.paged_batch import rel_err
from tests.tiny_models import make_tiny_model

KQ = (T.Q4_K, T.Q5_K, T.Q6_K)
# name -> (GGUF architecture, shape overrides, the experts' types (gate, up, down), every other
# matrix's type); widths of K-quant experts are multiples of 256
CASES = {
    "qwen3-moe": ("qwen3moe", {}, (T.Q4_0, T.Q4_0, T.Q8_0), T.Q8_0),
    "mixtral": ("llama", {}, (T.Q4_1, T.Q5_0, T.Q8_0), T.Q8_0),
    "qwen2-moe": ("qwen2moe", dict(hidden_size=256, intermediate_size=256, head_dim=64,
                                   moe_intermediate_size=256,
                                   shared_expert_intermediate_size=256),
                  (T.Q4_K, T.Q5_K, T.Q6_K), T.Q8_0),
}


def _quantize(a: np.ndarray, qt: T) -> np.ndarray:
    """gguf's quantizer; K-quants as valid blocks of random bytes (the `gguf` package has none:
    the reference reads the same blocks back)."""
    if qt not in KQ:
        return gguf_quantize(a, qt)
    rows = int(np.prod(a.shape[:-1]))
    rng = np.random.default_rng(rows * 7 + a.shape[-1] + int(qt))
    data = random_blocks(qt, rows, a.shape[-1], rng).data.numpy()
    return data.reshape(*a.shape[:-1], -1)


def write_moe_gguf(folder: Path, out: Path, arch: str, base: T, experts: tuple[T, T, T],
                   **overrides: T) -> Path:
    """`folder`'s checkpoint as a GGUF whose expert tensors are of the `experts` types (gate,
    up, down), the other matrices `base` or as `overrides` say (K-quants: _quantize's)."""
    gate, up, down = experts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_files, "quantize", _quantize)
        return gguf_files.write_gguf(folder, out, arch, base, overrides={
            "ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down, **overrides})


def moe_gguf(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """(the tiny GGUF, its Hugging Face folder). The router in F32, as llama.cpp keeps it."""
    arch, shape, experts, base = CASES[name]
    folder = make_tiny_model(name, tmp_path / name, **shape)
    shared = {"ffn_gate_shexp": T.Q4_K, "ffn_up_shexp": T.Q4_K} if experts[0] in KQ else {}
    out = write_moe_gguf(folder, tmp_path / f"{name}.gguf", arch, base, experts,
                         ffn_gate_inp=T.F32, **shared)
    return out, folder


def transformers_on_gguf(path: Path, folder: Path, tmp_path: Path):  # -> a transformers model
    """transformers' model of `folder`'s config on the GGUF file's weights, dequantized (by
    the fp32 path of Loom's GGUF reader: the `gguf` package's values), under the checkpoint's
    own names."""
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.model_config_from_gguf(reader, path)
    arch = gguf_loader.gguf_architecture(reader)
    mixtral = config.architecture == "MixtralForCausalLM"
    state = {}
    for name, w in gguf_loader.iter_gguf_tensors(reader, config, arch):
        if mixtral:
            for ours, theirs in (("mlp.gate.", "block_sparse_moe.gate."),
                                 ("mlp.experts.", "block_sparse_moe.experts."),
                                 ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                if ".experts." in name or ours == "mlp.gate.":
                    name = name.replace(ours, theirs)
        state[name] = w.contiguous()
    ref_folder = tmp_path / "reference"
    ref_folder.mkdir()
    (ref_folder / "config.json").write_text((folder / "config.json").read_text())
    save_file(state, str(ref_folder / "model.safetensors"), metadata={"format": "pt"})
    return transformers_model(ref_folder)


def _run(loaded) -> tuple[dict, dict, dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _mixed_batch(loaded, loaded.config.vocab_size)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_quantized_experts_match_transformers(tmp_path, name) -> None:
    require_cpu_kernels()
    path, folder = moe_gguf(tmp_path, name)
    loaded = load_model(resolve_model(str(path)), "float32", batch_invariant=True)
    block = next(m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock))
    gate, up, down = CASES[name][2]
    for expert in block.experts:  # each expert in its file's form, nothing in fp32
        gu, d = expert.gate_up_proj, expert.down_proj
        if gate in KQ:
            assert isinstance(gu, KQuantLinear) and gu.formats() == [gate.name, up.name]
            assert isinstance(d, KQuantLinear) and d.formats() == [down.name]
        else:
            assert isinstance(gu, Int8Linear) and gu.grouped
            # mixtral's Q4_1 gate and Q5_0 up would share the 5-bit form where it is kept
            five = loaded.kernels.five_bit and up == T.Q5_0
            assert gu.bits == (4 if gate == up == T.Q4_0 else Q5 if five else 8)
            assert isinstance(d, Int8Linear) and d.grouped
    assert not [n for n, p in loaded.model.named_parameters()
                if ".experts." in n and p.dtype.is_floating_point and p.dim() > 1]
    assert isinstance(block.gate, RouterLinear)  # the F32 router as it is
    prompts, logits, seqs = _run(loaded)
    reference = load_model(resolve_model(str(path)), "float32", quantization="none")
    _, ref_logits, ref_seqs = _run(reference)
    assert seqs == ref_seqs
    assert all(rel_err(logits[rid], ref_logits[rid]) < 1e-3 for rid in seqs)
    hf = transformers_on_gguf(path, folder, tmp_path)
    match_transformers(hf, prompts, logits, seqs, 1e-3)  # the quantized experts' kernels
    match_transformers(hf, prompts, ref_logits, ref_seqs, 1e-4)  # fp32



@pytest.mark.slow
def test_legacy_mixtral_layout(tmp_path) -> None:
    """llama.cpp's first Mixtral files store one 2-D tensor an expert (blk.N.ffn_gate.E.weight):
    they load as the stacked layout does, experts kept on the int8 grid, the same logits."""
    import re

    from loom.loader.gguf_file import read_gguf
    from tests.paged_batch import PagedBatch

    require_cpu_kernels()
    stacked, folder = moe_gguf(tmp_path / "stacked", "mixtral")
    kinds = {"w1": "gate", "w3": "up", "w2": "down"}

    def per_expert(tensors, cfg):  # noqa: ANN001, ANN202 (the old converter's names)
        return {re.sub(r"experts\.(\d+)\.(w\d)", lambda m: f"experts.{m[1]}.{kinds[m[2]]}_proj",
                       name.replace(".block_sparse_moe.", ".mlp.")): t
                for name, t in tensors.items()}

    names = {f"mlp.experts.{e}.{kind}_proj": f"ffn_{kind}.{e}"
             for e in range(4) for kind in kinds.values()}  # the tiny Mixtral's 4 experts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_files, "quantize", _quantize)
        mp.setattr(gguf_files, "_moe_tensors", per_expert)
        mp.setattr(gguf_files, "_NAMES", {**gguf_files._NAMES, **names})
        legacy = gguf_files.write_gguf(folder, tmp_path / "legacy.gguf", "llama", T.Q8_0,
                                       overrides={"ffn_gate": T.Q4_1, "ffn_up": T.Q5_0,
                                                  "ffn_gate_inp": T.F32})
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in read_gguf(legacy).tensors}
    a, b = (load_model(resolve_model(str(p)), "float32", batch_invariant=True)
            for p in (stacked, legacy))
    assert isinstance(b.model.model.layers[1].mlp.experts[3].gate_up_proj, Int8Linear)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    assert torch.equal(PagedBatch(a).step({"r": ids})["r"], PagedBatch(b).step({"r": ids})["r"])


@pytest.mark.slow
def test_float_dense_layers_keep_quantized_experts(tmp_path) -> None:
    """A file of F16 attention and quantized experts (the experts are most of a mixture's
    bytes) runs its experts from their blocks by default, not expanded to fp32 with the rest:
    the dense layers then take the int8 grid too (8 bits a weight, as --quantization int8 gives
    them), within int8's tolerance of the fp32 reference."""
    require_cpu_kernels()
    folder = make_tiny_model("qwen3-moe", tmp_path / "qwen3-moe")
    path = write_moe_gguf(folder, tmp_path / "f16.gguf", "qwen3moe", T.F16,
                          (T.Q4_0, T.Q4_0, T.Q8_0), ffn_gate_inp=T.F32)
    loaded = load_model(resolve_model(str(path)), "float32", batch_invariant=True)
    assert loaded.quantization == "int8"
    block = next(m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock))
    assert all(isinstance(e.gate_up_proj, Int8Linear) and e.gate_up_proj.grouped
               and e.gate_up_proj.bits == 4 for e in block.experts)
    q = loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(q, Int8Linear) and q.bits == 8
    prompts, logits, _ = _run(loaded)
    reference = load_model(resolve_model(str(path)), "float32", quantization="none")
    _, ref_logits, _ = _run(reference)
    for rid in ("a", "b"):  # their prompts' positions (a tiny random model's greedy tokens may
        n = len(prompts[rid])  # part on near-ties, and then so do the positions after them)
        assert rel_err(logits[rid][:n], ref_logits[rid][:n]) < 3e-2
