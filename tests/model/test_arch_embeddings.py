"""LLM.embed: the final hidden states of tiny random-weight decoders, pooled (last token or
mean) and normalised, match transformers' (cosine >= 0.9999), through the scheduler: chunked
prefill, several prompts at once, beside generation, and with the prefix cache on."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from loom.engine.llm import LLM
from loom.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_chat_model, make_tiny_model

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53],
           [9, 8, 7], [5, 17, 99, 3, 250, 7, 7, 40, 41, 42, 43, 44, 45, 46, 47, 48, 1, 2]]


def _tiny(name: str, folder):
    """A tiny model with SmolLM2's tokenizer beside it (the engine loads one)."""
    return make_tiny_chat_model(name, folder)


def _reference(folder, pooling: str) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            h = model(torch.tensor([ids])).last_hidden_state[0]  # [len, hidden]
            out.append(h[-1] if pooling == "last" else h.mean(0))
    return F.normalize(torch.stack(out), dim=-1)


@pytest.mark.parametrize("name,pooling", [("qwen3", "last"), ("gemma3", "mean"),
                                          ("llama", "mean")])
def test_embeddings_match_transformers_pooled_hidden_states(tmp_path, name, pooling) -> None:
    folder = _tiny(name, tmp_path / name)
    if pooling == "mean":  # declared as a sentence-transformers folder does
        (folder / "modules.json").write_text(json.dumps(
            [{"idx": 0, "name": "1", "path": "1_Pooling",
              "type": "sentence_transformers.models.Pooling"}]))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
             "pooling_mode_lasttoken": False, "pooling_mode_cls_token": False}))
    # 8 tokens a step: the 21-token prompt pools over three chunks, beside the others
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=8, max_model_len=64)
    assert llm.engine.model_config.pooling == pooling
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm the cache
    ref = _reference(folder, pooling)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    got = torch.tensor([o.embedding for o in outs])
    assert got.shape == ref.shape
    cos = (got * ref).sum(-1)
    assert float(cos.min()) >= 0.9999, cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(PROMPTS)))
    # the third prompt shares the first's first block: a prefix-cache hit must not change it
    again = torch.tensor(llm.embed(PROMPTS[2], use_tqdm=False)[0].embedding)
    assert float((again * ref[2]).sum()) >= 0.9999
    # embedding and generation in one batch
    llm.engine.add_request("g", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0))
    mixed = llm.embed(PROMPTS[:2], use_tqdm=False)
    assert float((torch.tensor(mixed[1].embedding) * ref[1]).sum()) >= 0.9999
    # truncate_prompt_tokens: the longest prompt's last 5 tokens, as they embed alone
    longest = max(PROMPTS, key=len)
    cut = llm.embed(longest, use_tqdm=False, truncate_prompt_tokens=5)[0]
    assert cut.prompt_token_ids == longest[-5:]
    assert cut.embedding == llm.embed([longest[-5:]], use_tqdm=False)[0].embedding
    llm.engine.check_integrity()


def test_pooling_is_checked(tmp_path) -> None:
    from loom.config import ConfigError
    from loom.errors import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="pooling"):
        SamplingParams(pooling="cls")
    folder = _tiny("llama", tmp_path / "m")
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "1", "path": "1_Pooling",
          "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ConfigError, match="pooling_mode_cls_token"):
        LLM(str(folder), dtype="float32")


def test_gguf_pooling_type(tmp_path) -> None:
    """llama.cpp's {arch}.pooling_type: 1 mean, 3 last; 2 (cls) is refused at load."""
    from loom.config import ConfigError
    from loom.loader.model_loader import load_model
    from loom.loader.resolve import resolve_model
    from tests.gguf_files import write_gguf

    folder = make_tiny_model("qwen3", tmp_path / "hf")
    for kind, pooling in ((1, "mean"), (3, "last")):
        path = write_gguf(folder, tmp_path / f"p{kind}.gguf", "qwen3",
                          uint32_keys={"{arch}.pooling_type": kind})
        assert load_model(resolve_model(str(path)), dtype="float32").config.pooling == pooling
    path = write_gguf(folder, tmp_path / "p2.gguf", "qwen3",
                      uint32_keys={"{arch}.pooling_type": 2})
    with pytest.raises(ConfigError, match="pooling type 2"):
        load_model(resolve_model(str(path)), dtype="float32")
