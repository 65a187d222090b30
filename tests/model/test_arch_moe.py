"""Mixtures of experts (tiny Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): a request
gives the same greedy tokens and logits alone as in a mixed batch whose other tokens route to
other experts; a checkpoint missing an expert is refused. (Fidelity against transformers:
test_fidelity_tiny.py's table.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.models.moe import SparseMoeBlock
from tests.paged_batch import PagedBatch, greedy, rel_err
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_batched_equals_alone(tmp_path, name) -> None:
    loaded = load_model(resolve_model(str(make_tiny_model(name, tmp_path / name))),
                        dtype="float32")
    assert any(isinstance(m, SparseMoeBlock) for m in loaded.model.modules())
    g = torch.Generator().manual_seed(3)
    prompts = {r: torch.randint(0, 256, (n,), generator=g).tolist()
               for r, n in (("a", 13), ("b", 30), ("c", 5))}
    alone_seq, alone_logits = greedy(loaded, {"a": prompts["a"]}, 12)
    seqs, logits = greedy(loaded, prompts, 12)
    assert seqs["a"] == alone_seq["a"]
    assert rel_err(logits["a"], alone_logits["a"]) < 1e-5


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_batched_equals_alone_on_the_c_stack(tmp_path, name) -> None:
    """int8 on the one-call C stack with the batch-invariant kernels: a request's logits alone
    and in a batch whose other tokens route to other experts are the same bits."""
    from loom.models.q8_decoder import Q8Decoder
    from tests.cpu_kernels import require_cpu_kernels

    require_cpu_kernels()
    loaded = load_model(resolve_model(str(make_tiny_model(name, tmp_path / name))),
                        dtype="float32", quantization="int8", batch_invariant=True)
    g = torch.Generator().manual_seed(4)
    prompts = {r: torch.randint(0, 256, (n,), generator=g).tolist()
               for r, n in (("a", 13), ("b", 30), ("c", 5))}
    alone_seq, alone_logits = greedy(loaded, {"a": prompts["a"]}, 8)
    seqs, logits = greedy(loaded, prompts, 8)
    assert isinstance(loaded.model.model.stack, Q8Decoder) and loaded.model.model.stack.moes
    assert seqs["a"] == alone_seq["a"]
    assert torch.equal(logits["a"], alone_logits["a"])


def test_missing_expert_is_refused(tmp_path) -> None:
    folder = make_tiny_model("mixtral", tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.mlp"):
        load_model(resolve_model(str(folder)), dtype="float32")


@pytest.mark.parametrize("name,arch", [("qwen3-moe", "qwen3moe"), ("qwen2-moe", "qwen2moe"),
                                       ("mixtral", "llama"), ("phi3", "phi3")])
def test_tiny_gguf_matches_hf_checkpoint(tmp_path, name, arch) -> None:
    """Experts stacked as llama.cpp stores them ([experts, rows, cols]; Mixtral is its "llama"
    with experts), Phi-3's fused tensors and LongRoPE factors: the same logits as the folder."""
    from tests.gguf_files import write_gguf

    folder = make_tiny_model(name, tmp_path / "hf")
    path = write_gguf(folder, tmp_path / f"{name}.gguf", arch)
    from_gguf = load_model(resolve_model(str(path)), dtype="float32")
    from_hf = load_model(resolve_model(str(folder)), dtype="float32")
    for key in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "moe_layers", "qk_norm",
                "attention_bias"):
        assert getattr(from_gguf.config, key) == getattr(from_hf.config, key), key
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    out_gguf = PagedBatch(from_gguf).step({"r": ids})["r"]
    out_hf = PagedBatch(from_hf).step({"r": ids})["r"]
    assert rel_err(out_gguf, out_hf) < 1e-5


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_sliding_window_is_read_or_refused(tmp_path, name) -> None:
    """Mixtral's window applies to every layer and is kept; Qwen's covers some layers only and
    is refused."""
    import json

    from loom.config import ConfigError
    from loom.loader.hf import model_config_from_hf

    folder = make_tiny_model(name, tmp_path / name)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 16}))
    if name == "mixtral":
        assert model_config_from_hf(folder).sliding_window == 16
    else:
        with pytest.raises(ConfigError, match="use_sliding_window=true is not supported"):
            model_config_from_hf(folder)
