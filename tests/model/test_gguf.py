"""GGUF: dequantization against the `gguf` package, the llama.cpp q/k permutation undone,
the real SmolLM2 file against transformers, and clear errors for bad files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import IQ4_NL, quantize

from loom.config import ConfigError
from loom.kernels.dispatch import KernelChoice
from loom.loader.gguf import GGUFError
from loom.loader.model_loader import load_model
from loom.loader.resolve import ModelNotFoundError, default_gguf_path, resolve_model
from loom.layers.embedding import VocabEmbedding
from loom.layers.linear import Linear
from loom.quant.fp16 import Fp16Linear
from loom.quant.gguf_dequant import IQ4_NL_LEVELS, TORCH_TYPES, _f16, dequantize, q8_groups
from loom.quant.int8 import IQ4, Q5, Int8Embedding, Int8Linear, unpack_nibbles, width
from tests.cpu_kernels import require_cpu_kernels
from tests.gguf_files import write_gguf
from tests.paged_batch import PagedBatch, rel_err
from tests.tiny_models import make_tiny_model

T = GGMLQuantizationType


def _nearest_levels(b: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Blocks of 32 [n, 32] over their scales [n, 1] -> the nearest IQ4_NL levels' indices as
    GGUF's 16 bytes of nibbles a block."""
    levels = np.array(IQ4_NL.kvalues)
    idx = np.abs(b[:, :, None] / np.maximum(d, 1e-30)[:, :, None] - levels).argmin(-1)
    return (idx[:, :16] | idx[:, 16:] << 4).astype(np.uint8)


def _quantize(x: np.ndarray, qtype) -> np.ndarray:
    """The `gguf` package's quantizer, and plain nearest-level ones for IQ4_NL and IQ4_XS (which
    it lacks): IQ4_NL d = max|x| / 127 a block of 32; IQ4_XS a sub-block's scale d (ls - 32)
    as near max|x| / 127 as d = the largest of them / 31 allows; each value's nearest level."""
    if qtype not in (T.IQ4_NL, T.IQ4_XS):
        return quantize(x, qtype)
    b = x.reshape(-1, 32)
    want = np.abs(b).max(1, keepdims=True) / 127
    if qtype == T.IQ4_NL:
        d = want.astype(np.float16)
        return np.concatenate([d.view(np.uint8), _nearest_levels(b, d)], 1).reshape(
            x.shape[0], -1)
    want = want.reshape(-1, 8)
    d = (want.max(1, keepdims=True) / 31).astype(np.float16)
    ls = np.clip(np.rint(want / np.maximum(d.astype(np.float32), 1e-30)), 1, 31) + 32
    ls = ls.astype(np.int64)
    high = (((ls >> 4) & 3) << 2 * np.arange(8)).sum(1, keepdims=True).astype(np.uint16)
    low = (ls[:, 0::2] & 15 | (ls[:, 1::2] & 15) << 4).astype(np.uint8)
    scale = (d.astype(np.float32) * (ls - 32)).reshape(-1, 1)
    qs = _nearest_levels(b, scale).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8), high.view(np.uint8), low, qs], 1).reshape(
        x.shape[0], -1)


@pytest.mark.parametrize("qtype", sorted(TORCH_TYPES | {T.F16, T.BF16}, key=lambda t: t.value))
def test_torch_dequant_equals_gguf_reference(qtype) -> None:
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * 3
    raw = _quantize(x, qtype)
    ours = dequantize(raw, qtype, (8, 256))
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert rel_err(ours, torch.from_numpy(x)) < 0.2  # and it is a real approximation of x


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL])
def test_k_quant_blocks_dequantize_to_the_reference(qtype) -> None:
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (4, size * (512 // block)), dtype=np.uint8)
    # Random bytes are valid blocks; some f16 scales decode to NaN/inf, so NaNs compare equal.
    ours = dequantize(raw, qtype, (4, 512))
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


def _iq4_xs_reference(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS super-blocks [n, 136] -> (levels + 128 [8n, 32], scales d (ls - 32) [8n, 1]) in
    torch, as ggml's dequantize_row_iq4_xs reads them: the C conversion's reference (its values
    and scales)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    high = blocks[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # [n, 1]
    j = torch.arange(8)
    ls = ((blocks[:, 4 + j // 2].int() >> 4 * (j % 2)) & 15) | ((high >> 2 * j) & 3) << 4
    q = IQ4_NL_LEVELS[unpack_nibbles(blocks[:, 8:].reshape(8 * n, 16)).long()]
    return q.to(torch.uint8), (d * (ls - 32).float()).reshape(-1, 1)


def test_iq4_xs_converts_to_the_int8_grid_exactly() -> None:
    """IQ4_XS's sub-blocks of 32 on the int8 grid's IQ4 form (the index nibbles as stored,
    standing for levels + 128; scale d (ls - 32), minimum -128 scale): every weight the `gguf`
    package's value, for every scale byte pattern."""
    size = GGML_QUANT_SIZES[T.IQ4_XS][1]
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (6, 4 * size), dtype=np.uint8)
    d = (rng.random(24) * 1e-2).astype(np.float16)  # finite fp16 d; the rest random bytes
    raw.reshape(-1, size)[:, :2] = d.view(np.uint8).reshape(-1, 2)
    g = q8_groups(raw, T.IQ4_XS, (6, 1024))
    assert g.bits == IQ4 and g.q.shape == (6, 512) and g.scale.shape == (6, 32)
    # the grid's table (the float32 path's too) is ggml's levels + 128
    assert torch.equal(IQ4_NL_LEVELS, torch.tensor(IQ4_NL.kvalues, dtype=torch.int16) + 128)
    ref = torch.from_numpy(gguf_dequantize(raw, T.IQ4_XS).astype(np.float64)).reshape(6, 1024)
    assert (g.min == -128 * g.scale).all()
    exact = (g.values().double() - 128) * g.scale.double().repeat_interleave(32, 1)
    torch.testing.assert_close(exact, ref, rtol=0, atol=0)
    torch.testing.assert_close(g.dequantize(), ref.float(), rtol=0, atol=0)
    # the C conversion keeps ggml's index bytes and gives its sub-blocks' values and scales
    blocks = torch.from_numpy(raw.reshape(-1, size))
    q, scale = _iq4_xs_reference(blocks)
    assert torch.equal(g.q, blocks[:, 8:].reshape(6, 512))
    assert torch.equal(q.reshape(6, 1024), g.values()) and torch.equal(scale.reshape(6, 32),
                                                                      g.scale)


@pytest.mark.parametrize("name,arch", [("qwen3-moe", "qwen3moe"), ("qwen2-moe", "qwen2moe")])
def test_iq4_nl_experts_keep_their_indices(tmp_path, name, arch) -> None:
    """A mixture of experts in IQ4_NL, its stacked [experts, rows, cols] tensors too: every
    expert's linears keep the 4-bit indices (bits IQ4), a linear no 32-wide block fits
    (Qwen2-MoE's 48-wide shared expert, F32 in the file) keeps its values in fp32, and the
    logits are the fp32 reference's but for the sums' order (the fp32 kernels)."""
    from loom.entrypoints.openai.startup import _kept
    from loom.models.moe import SparseMoeBlock

    require_cpu_kernels()
    folder = make_tiny_model(name, tmp_path / "hf")
    f32 = write_gguf(folder, tmp_path / "f32.gguf", arch)
    raw = {}
    for t in GGUFReader(str(f32)).tensors:
        x = np.asarray(t.data, dtype=np.float32)
        if x.ndim >= 2 and x.shape[-1] % 32 == 0:
            q = _quantize(x.reshape(-1, x.shape[-1]), T.IQ4_NL)
            raw[t.name] = (q.reshape(*x.shape[:-1], -1), T.IQ4_NL)
    source = resolve_model(str(write_gguf(folder, tmp_path / "iq4.gguf", arch, raw=raw)))
    got = load_model(source, dtype="float32", batch_invariant=True)
    block = next(m for m in got.model.modules() if isinstance(m, SparseMoeBlock))
    assert all(isinstance(e.down_proj, Int8Linear) and e.down_proj.bits == IQ4
               for e in block.experts)
    assert _kept(got.model) == "int8 groups of 32 (exact, IQ4 as 4-bit level indices)"
    if block.shared_expert is not None:  # 48 wide: F32 in the file, fp32 here
        assert type(block.shared_expert.down_proj) is Linear
    ref = load_model(source, dtype="float32", quantization="none")
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    out_ref, out = PagedBatch(ref).step({"r": ids})["r"], PagedBatch(got).step({"r": ids})["r"]
    assert rel_err(out, out_ref) < 1e-5


@pytest.mark.slow
def test_smollm2_tensors_equal_gguf_reference() -> None:
    reader = GGUFReader(str(default_gguf_path()))
    types = set()
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        ref = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(t.data, t.tensor_type)))
        ours = dequantize(t.data, t.tensor_type, shape)
        torch.testing.assert_close(ours, ref.reshape(shape).float(), rtol=0, atol=0)
        types.add(t.tensor_type.name)
    assert {"Q4_1", "Q8_0", "F32"} <= types


@pytest.mark.parametrize(
    "name,arch,qtype",
    [("llama", "llama", T.F32), ("llama-tied", "llama", T.F16), ("qwen2", "qwen2", T.F32),
     ("qwen3", "qwen3", T.F32)],
)
def test_tiny_gguf_matches_hf_checkpoint(tmp_path, name, arch, qtype) -> None:
    folder = make_tiny_model(name, tmp_path / "hf")
    gguf_path = write_gguf(folder, tmp_path / f"{name}.gguf", arch, qtype)
    from_gguf = load_model(resolve_model(str(gguf_path)), dtype="float32", quantization="none")
    from_hf = load_model(resolve_model(str(folder)), dtype="float32", quantization="none")
    assert from_gguf.config.tie_word_embeddings == from_hf.config.tie_word_embeddings
    assert from_gguf.config.attention_bias == from_hf.config.attention_bias
    assert from_gguf.config.qk_norm == from_hf.config.qk_norm
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    out_gguf = PagedBatch(from_gguf).step({"r": ids})["r"]
    out_hf = PagedBatch(from_hf).step({"r": ids})["r"]
    tol = 1e-5 if qtype == T.F32 else 1e-2  # F16 storage rounds the weights
    assert rel_err(out_gguf, out_hf) < tol


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_transformers):
    from loom.tokenizer.tokenizer import Tokenizer

    loaded = load_model(resolve_model(None), dtype="float32", quantization="none")
    tok = Tokenizer.from_source(resolve_model(None), loaded.config.eos_token_ids)
    return smollm2_transformers, loaded, tok


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2) -> None:
    ref, loaded, tok = smollm2
    batch = PagedBatch(loaded, num_blocks=64)
    prompts = {str(i): tok.encode(p) for i, p in enumerate(PROMPTS)}
    seqs = {rid: list(ids) for rid, ids in prompts.items()}
    out = batch.step(prompts)  # all five prefilled in one batch
    for _ in range(32):
        for rid in seqs:
            seqs[rid].append(int(out[rid][-1].argmax()))
        out = batch.step({rid: s[-1:] for rid, s in seqs.items()})
    for rid, prompt in prompts.items():
        ours = seqs[rid][len(prompt) :]
        # transformers' generate stops at EOS: its output must be a prefix of ours ...
        expected = ref.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
            pad_token_id=tok.hf.pad_token_id,
        )[0, len(prompt):].tolist()
        assert ours[: len(expected)] == expected, PROMPTS[int(rid)]
        # ... and all 32 of ours are transformers' argmax given the same prefix.
        with torch.no_grad():
            logits = ref(torch.tensor([seqs[rid]])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == ours, PROMPTS[int(rid)]


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a prime number."},
]


@pytest.mark.slow
def test_chat_template_gguf_and_hf_folder_match_transformers(smollm2, smollm2_auto_tokenizer,
                                                            tmp_path) -> None:
    import copy

    from transformers import AutoTokenizer

    from loom.tokenizer.tokenizer import Tokenizer

    _, _, tok = smollm2
    ref = copy.deepcopy(smollm2_auto_tokenizer)  # its chat template is changed below
    for gen in (True, False):
        expected = ref.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen) == expected
    assert "<|im_start|>assistant\n" in tok.apply_chat_template(CONVERSATION)

    folder = make_tiny_model("llama", tmp_path / "hf")
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant] {% endif %}"
    ref.chat_template = template
    ref.save_pretrained(folder)
    hf_tok = Tokenizer.from_source(resolve_model(str(folder)))
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert hf_tok.apply_chat_template(CONVERSATION) == expected
    assert expected.endswith("[assistant] ")


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model("no-such-org/no-such-model")


def test_truncated_gguf_is_a_clear_error(tmp_path) -> None:
    src = default_gguf_path()
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(2_000_000))
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        load_model(resolve_model(str(bad)))


def test_unsupported_gguf_architecture(tmp_path) -> None:
    folder = make_tiny_model("llama", tmp_path / "hf")
    path = write_gguf(folder, tmp_path / "gpt2.gguf", "llama", override_arch="gpt2")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(resolve_model(str(path)))


def test_unsupported_hf_architecture_and_bad_heads(tmp_path) -> None:
    folder = make_tiny_model("llama", tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(resolve_model(str(bad)))
    (bad / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 5}))
    with pytest.raises(ConfigError, match=r"num_attention_heads \(5\) is not a multiple"):
        load_model(resolve_model(str(bad)))


def test_unsupported_tensor_type_names_the_tensor(tmp_path) -> None:
    path = tmp_path / "i32.gguf"
    w = GGUFWriter(str(path), "llama")
    for key, value in [("add_block_count", 1), ("add_context_length", 64), ("add_embedding_length", 8),
                       ("add_feed_forward_length", 16), ("add_head_count", 2),
                       ("add_head_count_kv", 2), ("add_vocab_size", 4)]:
        getattr(w, key)(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="token_embd.weight.*I32.*not supported"):
        load_model(resolve_model(str(path)))


def _grid_bits(qtype: T, five: bool = True) -> int:
    """The int8 grid's form for a tensor of `qtype` (Q5_0 / Q5_1: 5 bits where `five`)."""
    return {T.Q4_0: 4, T.Q4_1: 4, T.IQ4_NL: IQ4, T.IQ4_XS: IQ4, T.Q5_0: Q5 if five else 8,
            T.Q5_1: Q5 if five else 8}.get(qtype, 8)


@pytest.mark.parametrize("qtype", sorted(TORCH_TYPES, key=lambda t: t.value))
def test_q8_groups_hold_the_dequantized_values(qtype) -> None:
    """int8 loads GGUF's 32-wide block formats onto its grid as they are: the same floats."""
    x = np.random.default_rng(2).standard_normal((6, 128)).astype(np.float32)
    raw = _quantize(x, qtype)
    groups = q8_groups(raw, qtype, (6, 128))
    assert groups.q.dtype == torch.uint8 and groups.scale.shape == groups.min.shape == (6, 4)
    # Q4_0, Q4_1 and IQ4_NL keep their nibbles, two weights a byte (IQ4_NL's level indices),
    # Q5_0 and Q5_1 their nibbles and fifth bits
    bits = _grid_bits(qtype)
    assert groups.bits == bits and groups.q.shape == (6, 128 * width(bits) // 8)
    torch.testing.assert_close(groups.dequantize(), dequantize(raw, qtype, (6, 128)), rtol=0, atol=0)
    wide = q8_groups(raw, qtype, (6, 128), five=False)  # Q5_0 / Q5_1 a byte a weight
    assert wide.bits == _grid_bits(qtype, five=False)
    torch.testing.assert_close(wide.dequantize(), groups.dequantize(), rtol=0, atol=0)


def test_q8_groups_only_take_32_wide_block_formats() -> None:
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    block, size = GGML_QUANT_SIZES[T.Q6_K]
    q6k = np.random.default_rng(4).integers(0, 256, (4, size * (256 // block)), dtype=np.uint8)
    assert q8_groups(q6k, T.Q6_K, (4, 256)) is None
    assert q8_groups(x.astype(np.float16), T.F16, (4, 256)) is None
    assert q8_groups(quantize(x[0], T.Q8_0), T.Q8_0, (256,)) is None


@pytest.mark.parametrize("name,arch,qtype,overrides", [
    ("llama", "llama", T.Q4_0, {}),  # untied head, permuted q/k rows; 4 bits a weight
    # 4-bit where every source of a layer is: qkv takes 8 bits, o and gate_up 4, down 5
    ("llama", "llama", T.Q4_1, {"attn_v": T.Q8_0, "ffn_down": T.Q5_0}),
    ("llama", "llama", T.Q4_0, {"attn_v": T.Q5_0}),  # qkv's 4- and 5-bit sources: 5 bits
    ("qwen2", "qwen2", T.Q8_0, {}),  # tied embedding and head, q/k/v biases
    ("llama-tied", "llama", T.Q4_0, {}),  # a tied head on 4-bit embeddings
    ("qwen3", "qwen3", T.Q5_1, {}),  # q/k norms: the per-module path
    ("llama-tied", "llama", T.F16, {}),  # no block format: float rows quantized as they load
])
def test_int8_loads_gguf_blocks_without_fp32(tmp_path, name, arch, qtype, overrides) -> None:
    require_cpu_kernels()
    folder = make_tiny_model(name, tmp_path / "hf")
    source = resolve_model(str(write_gguf(folder, tmp_path / f"{name}.gguf", arch, qtype,
                                          overrides=overrides)))
    ref = load_model(source, dtype="float32", quantization="none")
    q8 = load_model(source, dtype="float32", quantization="int8", batch_invariant=True)
    linears = {n: m for n, m in q8.model.model.named_modules() if isinstance(m, Int8Linear)}
    assert len(linears) == 2 * 4 and all(m.grouped for m in linears.values())
    sources = {"qkv_proj": ["attn_q", "attn_k", "attn_v"], "o_proj": ["attn_output"],
               "gate_up_proj": ["ffn_gate", "ffn_up"], "down_proj": ["ffn_down"]}
    five = q8.kernels.five_bit  # False here (batch_invariant): Q5_0 / Q5_1 a byte a weight
    for n, m in linears.items():
        codes = {_grid_bits(overrides.get(s, qtype), five)
                 for s in sources[n.rpartition(".")[2]]}
        bits = Q5 if codes == {4, Q5} else codes.pop() if len(codes) == 1 else 8
        assert m.bits == bits and m.weight_int8.shape[1] == m.in_features * width(bits) // 8
    embed, head = q8.model.model.embed_tokens, q8.model.lm_head
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    out_ref, out_q8 = PagedBatch(ref).step({"r": ids})["r"], PagedBatch(q8).step({"r": ids})["r"]
    if qtype == T.F16:  # requantized: close, not exact; the head stays fp16
        assert isinstance(embed, VocabEmbedding) and isinstance(head, Fp16Linear)
        assert rel_err(out_q8, out_ref) < 0.02
        return
    assert isinstance(embed, Int8Embedding) and isinstance(head, Int8Linear)
    assert (head.weight_int8 is embed.weight_int8) == q8.config.tie_word_embeddings
    assert embed.bits == head.bits == _grid_bits(qtype, five)
    torch.testing.assert_close(embed(torch.tensor(ids)), ref.model.model.embed_tokens(
        torch.tensor(ids)), rtol=0, atol=0)
    assert rel_err(out_q8, out_ref) < 1e-5  # the file's values exactly: only the sums' order


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda q: q.name)
def test_q5_keeps_five_bits_where_the_kernels_gain(tmp_path, qtype, monkeypatch) -> None:
    """A Q5_0 / Q5_1 file: by default its linears, embedding and head take the int8 grid's 5-bit
    form where decode runs the AVX-512 VNNI kernel (KernelChoice.five_bit), else a byte a
    weight, near the fp32 reference either way (the default kernels: VNNI's two-digit x up to 8
    rows, the batch kernel past); with the form forced onto the fp32 kernels (any x86 or ARM
    CPU), the reference's logits but for the sums' order."""
    require_cpu_kernels()
    folder = make_tiny_model("llama", tmp_path / "hf")
    source = resolve_model(str(write_gguf(folder, tmp_path / "q5.gguf", "llama", qtype)))
    ref = load_model(source, dtype="float32", quantization="none")
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    out_ref = PagedBatch(ref).step({"r": ids})["r"]
    fast = load_model(source, dtype="float32")
    bits = Q5 if fast.kernels.five_bit else 8
    grid = [m for m in fast.model.modules() if isinstance(m, (Int8Linear, Int8Embedding))]
    assert len(grid) == 2 * 4 + 2 and all(m.bits == bits for m in grid)
    batch = PagedBatch(fast)
    batch.step({"r": ids[:5]})
    assert rel_err(batch.step({"r": ids[5:6]})["r"], out_ref[5:6]) < 2e-3
    assert rel_err(PagedBatch(fast).step({"r": ids})["r"], out_ref) < 2e-2
    monkeypatch.setattr(KernelChoice, "five_bit", property(lambda self: True))
    exact = load_model(source, dtype="float32", batch_invariant=True)
    grid = [m for m in exact.model.modules() if isinstance(m, (Int8Linear, Int8Embedding))]
    assert all(m.bits == Q5 for m in grid)
    assert all(m.weight_int8.shape[1] == m.in_features * 5 // 8 for m in grid
               if isinstance(m, Int8Linear))
    assert rel_err(PagedBatch(exact).step({"r": ids})["r"], out_ref) < 1e-5


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_1], ids=lambda q: q.name)
def test_symmetric_groups_keep_no_fp32_minimums(tmp_path, qtype, monkeypatch) -> None:
    """A file of symmetric blocks (Q4_0, Q5_0, Q8_0: every minimum -zero x its scale) holds no
    fp32 minimums once loaded, in its linears and embedding alike: the kernels form each from
    its scale (loom.h's loom_q8_min), the same floats, so the same logits bit for bit as with
    them stored, on the default kernels and the fp32 (batch-invariant) ones, for a prompt's
    step past 8 rows and decode steps. Q4_1's minimums are its own: kept; and Q5_0's where it
    takes a byte a weight (its zero point 16 is not the byte form's 128)."""
    require_cpu_kernels()
    folder = make_tiny_model("llama", tmp_path / "hf")
    source = resolve_model(str(write_gguf(folder, tmp_path / "q.gguf", "llama", qtype)))
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    symmetric = qtype != T.Q4_1

    def run(loaded) -> list[torch.Tensor]:  # noqa: ANN001
        batch = PagedBatch(loaded)
        return [batch.step({"r": ids[:12]})["r"], batch.step({"r": ids[12:13]})["r"],
                batch.step({"r": ids[13:14]})["r"]]

    for batch_invariant in (False, True):
        lean = load_model(source, dtype="float32", batch_invariant=batch_invariant)
        grid = [m for m in lean.model.modules() if isinstance(m, (Int8Linear, Int8Embedding))]
        assert len(grid) == 2 * 4 + 2
        sym = symmetric and (qtype != T.Q5_0 or grid[0].bits == Q5)
        assert all(m.symmetric == sym and (m.min.numel() == 0) == sym for m in grid)
        with monkeypatch.context() as patch:  # the minimums kept, as before
            patch.setattr(Int8Linear, "drop_symmetric_mins", lambda self: False)
            patch.setattr(Int8Embedding, "drop_symmetric_mins", lambda self: False)
            full = load_model(source, dtype="float32", batch_invariant=batch_invariant)
        assert not any(m.symmetric for m in full.model.modules()
                       if isinstance(m, (Int8Linear, Int8Embedding)))
        for a, b in zip(run(lean), run(full)):
            assert torch.equal(a, b)
        tokens = torch.tensor(ids)  # the module path's lookup (the C stack has its own)
        assert torch.equal(lean.model.model.embed_tokens(tokens),
                           full.model.model.embed_tokens(tokens))
        for m in grid:  # the minimums as the reference path reads them: the stored ones
            twin = full.model.get_submodule(next(n for n, x in lean.model.named_modules()
                                                 if x is m))
            assert torch.equal(m.groups.min, twin.min)


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS], ids=lambda q: q.name)
def test_iq4_runs_on_the_int8_grid_by_default(tmp_path, qtype) -> None:
    """An IQ4_NL or IQ4_XS file (every 2-D tensor in it) keeps its values exactly by default, at
    4 bits a weight: its index nibbles as stored on Loom's int8 grid (bits IQ4: each stands for
    its level + 128; scale d, or IQ4_XS's d (ls - 32) a sub-block; minimum -128 times it), no
    fp32 expansion; the logits are the fp32 reference's but for the sums' order (the fp32
    kernels), and near them on the default kernels (the VNNI decode's two-digit x)."""
    require_cpu_kernels()
    wide = ({"hidden_size": 256, "intermediate_size": 256, "head_dim": 64} if qtype == T.IQ4_XS
            else {})
    folder = make_tiny_model("llama", tmp_path / "hf", **wide)  # IQ4_XS: rows of 256s
    f32 = write_gguf(folder, tmp_path / "f32.gguf", "llama")
    raw = {t.name: (_quantize(np.asarray(t.data, dtype=np.float32), qtype), qtype)
           for t in GGUFReader(str(f32)).tensors if len(t.shape) == 2}
    source = resolve_model(str(write_gguf(folder, tmp_path / "iq4.gguf", "llama", raw=raw)))
    ref = load_model(source, dtype="float32", quantization="none")
    got = load_model(source, dtype="float32", batch_invariant=True)
    assert got.quantization == "int8"
    linears = [m for m in got.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 4 + 1 and all(m.grouped and m.bits == IQ4 for m in linears)
    assert all(m.weight_int8.shape[1] == m.in_features // 2 for m in linears)
    assert isinstance(got.model.model.embed_tokens, Int8Embedding)
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    out_ref, out = PagedBatch(ref).step({"r": ids})["r"], PagedBatch(got).step({"r": ids})["r"]
    assert rel_err(out, out_ref) < 1e-5
    # the default kernels: up to 8 rows VNNI's (or AVX2's) integers, past 8 the batch kernel
    # (bf16 on AVX512-BF16 CPUs); Q4_0 and Q8_0 files measured the same errors (7e-5, 4e-3);
    # IQ4_XS's decode 6e-4: the VNNI kernel reads its scales d (ls - 32) rounded to fp16
    fast = load_model(source, dtype="float32")
    batch = PagedBatch(fast)
    batch.step({"r": ids[:5]})
    assert rel_err(batch.step({"r": ids[5:6]})["r"], out_ref[5:6]) < 2e-3
    assert rel_err(PagedBatch(fast).step({"r": ids})["r"], out_ref) < 2e-2
