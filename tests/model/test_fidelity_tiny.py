"""Tiny random-weight models of each architecture: Loom's paged, mixed-batch forward equals
transformers' (fp32 logits within 1e-4 relative error, identical greedy tokens)."""

from __future__ import annotations

import pytest
import torch

from loom.kernels import cpu_ops
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from tests.cpu_kernels import require_cpu_kernels
from tests.paged_batch import BLOCK, PagedBatch, rel_err
from tests.tiny_models import ARCHS, make_tiny_model


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    ref.generation_config.eos_token_id = None  # 32 greedy tokens, an eos among them or not
    return request.param, folder, ref


@pytest.mark.parametrize("backend", ["kernel", pytest.param("torch", marks=pytest.mark.slow)])
def test_mixed_batch_matches_transformers(tiny, backend, monkeypatch) -> None:
    """Both paths: the C kernels (the CPU default) and torch's ops (CUDA, other dtypes)."""
    name, folder, ref = tiny
    loaded = load_model(resolve_model(str(folder)), dtype="float32", quantization="none")
    if backend == "kernel":
        require_cpu_kernels()
    else:
        monkeypatch.setattr(cpu_ops, "usable", lambda x: False)
    for attn in loaded.model.attention_layers():
        attn.use_kernel = backend == "kernel"
    g = torch.Generator().manual_seed(1)
    vocab = loaded.config.vocab_size
    a = torch.randint(0, vocab, (20,), generator=g).tolist()
    b = torch.randint(0, vocab, (11,), generator=g).tolist()
    c = a[:BLOCK] + torch.randint(0, vocab, (9,), generator=g).tolist()  # shares a's first block
    batch = PagedBatch(loaded)
    cached = 0 if batch.hybrid else BLOCK  # (a hybrid's states are not cached: c runs whole)
    batch.add("a")
    batch.add("b")
    seqs = {"a": list(a), "b": list(b), "c": list(c)}
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}

    # Step 0: a prefills whole, b prefills a first chunk.
    out = batch.step({"a": a, "b": b[:5]})
    got["a"].append(out["a"])
    got["b"].append(out["b"])
    # Step 1: a decodes, b finishes its prompt, c starts with a's first block already cached
    # (a hybrid's from the start).
    batch.add("c", shared_blocks=batch.blocks["a"][:cached // BLOCK], num_cached=cached)
    seqs["a"].append(int(out["a"][-1].argmax()))
    out = batch.step({"a": seqs["a"][-1:], "b": b[5:], "c": c[cached:]})
    for rid in out:
        got[rid].append(out[rid])
    # Greedy decode, all three together: each request feeds back its argmax.
    for _ in range(32):
        for rid in seqs:
            seqs[rid].append(int(got[rid][-1][-1].argmax()))
        out = batch.step({rid: seqs[rid][-1:] for rid in seqs})
        for rid in out:
            got[rid].append(out[rid])

    for rid, seq in seqs.items():
        loom_logits = torch.cat(got[rid])  # logits for every position computed by Loom
        start = cached if rid == "c" else 0
        with torch.no_grad():
            ref_logits = ref(torch.tensor([seq])).logits[0]
        ref_logits = ref_logits[start : start + loom_logits.shape[0]]
        prefill = len({"a": a, "b": b, "c": c}[rid]) - start
        assert rel_err(loom_logits[:prefill], ref_logits[:prefill]) < 1e-4, (name, rid, "prefill")
        decode = slice(prefill, prefill + 16)
        assert rel_err(loom_logits[decode], ref_logits[decode]) < 1e-4, (name, rid, "decode")
        # Greedy: transformers' own generate gives the same 32 tokens.
        prompt = {"a": a, "b": b, "c": c}[rid]
        gen = ref.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert seq[len(prompt) : len(prompt) + 32] == gen, (name, rid)
