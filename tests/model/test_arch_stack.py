"""Every architecture on the fast CPU path: int8 weights, the whole stack in one C call
(loom/models/q8_decoder.py walking the layers' own description), in one mixed paged batch.

The tiny checkpoints' linear weights are put on Loom's int8 grid (and the output projection on
fp16's) before saving, so transformers runs the very weights the int8 path runs: its logits must
match to fp32 tolerance and its greedy tokens exactly. The same batch through the per-module
path must give the stack's bits. (The fp32 reference path of every architecture:
tests/model/test_fidelity_tiny.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.models.q8_decoder import Q8Decoder
from loom.quant.int8 import Q8Groups, quantize_groups
from tests.cpu_kernels import require_cpu_kernels
from tests.paged_batch import BLOCK, PagedBatch, rel_err
from tests.tiny_models import make_tiny_model

STEPS = 12  # greedy decode steps of the mixed batch


def _on_grid(folder: Path) -> Path:
    """Rewrite the checkpoint's linear weights (stacked experts' each) as their int8-grid values
    (Q8Groups: groups of 32, q * scale + min) and the embeddings / head as fp16 values: what Loom's int8 load keeps
    (a mixture of experts' router and shared-expert gate, `*gate.weight`, stay fp32)."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    for name, w in weights.items():
        if "embed_tokens" in name or "lm_head" in name:
            weights[name] = w.half().float()
        elif w.dim() == 2 and w.shape[1] % 32 == 0 and not name.endswith("gate.weight"):
            weights[name] = Q8Groups(*quantize_groups(w)).dequantize().contiguous()
        elif w.dim() == 3 and w.shape[2] % 32 == 0:  # experts stacked (Granite's): each's
            weights[name] = torch.stack([Q8Groups(*quantize_groups(e)).dequantize()
                                         for e in w]).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def transformers_model(folder: Path):  # -> transformers' model
    """`folder`'s checkpoint in transformers: fp32, eager attention, every greedy token (an eos
    among them or not)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None
    return ref


def _mixed_batch(loaded, vocab: int) -> tuple[dict[str, list[int]], dict[str, torch.Tensor],
                                               dict[str, list[int]]]:
    """a prefills whole while b prefills a first chunk; then a decodes, b finishes, c starts
    on a's cached first block (a hybrid model's: from the start); then all three decode
    greedily. Returns (prompts, every computed position's logits, sequences)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, vocab, (20,), generator=g).tolist()
    b = torch.randint(0, vocab, (11,), generator=g).tolist()
    c = a[:BLOCK] + torch.randint(0, vocab, (9,), generator=g).tolist()
    batch = PagedBatch(loaded)
    prompts, seqs = {"a": a, "b": b, "c": c}, {"a": list(a), "b": list(b), "c": list(c)}
    got: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}
    out = batch.step({"a": a, "b": b[:5]})
    cached = 0 if batch.hybrid else BLOCK
    batch.add("c", shared_blocks=batch.blocks["a"][:cached // BLOCK], num_cached=cached)
    seqs["a"].append(int(out["a"][-1].argmax()))
    for r in out:
        got[r].append(out[r])
    out = batch.step({"a": seqs["a"][-1:], "b": b[5:], "c": c[cached:]})
    for _ in range(STEPS):
        for r in out:
            got[r].append(out[r])
        for r in seqs:
            seqs[r].append(int(got[r][-1][-1].argmax()))
        out = batch.step({r: s[-1:] for r, s in seqs.items()})
    return prompts, {r: torch.cat(v) for r, v in got.items()}, seqs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", "gemma2", "phi3",
                                  "phi3-partial", "smollm3", "granite", "glm4", "olmo2",
                                  "exaone4", "gemma", "granite4", "qwen3_5", "lfm2",
                                  "granite4-h", "nemotron-h"])
def test_int8_stack_matches_transformers_on_grid_weights(tmp_path, name, monkeypatch) -> None:
    """Llama, Qwen2 (q/k/v bias, tied head), Qwen3 (q/k norms), Gemma 3 (q/k norms, four norms
    a layer, GELU-tanh, scaled embeddings, sliding and global layers with their own RoPE
    bases), Gemma 2 (attention and final-logit soft caps), Phi-3 (fused checkpoint
    projections, LongRoPE; partial rotary: rows reordered on the int8 grid), SmolLM3 (NoPE
    layers), Granite (its multipliers, folded), GLM-4 (interleaved partial rotary, output
    norms), OLMo 2 (no input norms, q/k norms over all heads), EXAONE 4 (OLMo 2's norms, a
    sliding layer, a full one without RoPE), Gemma 1 (Llama's layer, Gemma's norms and MLP),
    Granite 4.0's dense transformer (Granite's layer under Granite 4.0's names), and the
    hybrids' decode steps (Qwen3.5: Gated DeltaNet, gated attention with a partial rotary;
    LFM2: short convolutions; Granite 4.0-H: Mamba2, attention without positions; Nemotron-H:
    one block a layer, relu^2 MLPs; their prompts run layer by layer): the C stack runs each,
    its logits
    are transformers' on the same weights, its tokens transformers' greedy ones, and the
    module path gives its bits."""
    require_cpu_kernels()
    folder = _on_grid(make_tiny_model(name, tmp_path / name))
    ref = transformers_model(folder)
    # the fp32 kernels (batch-invariant): the bf16 batch kernel rounds activations
    loaded = load_model(resolve_model(str(folder)), "float32", quantization="int8",
                        batch_invariant=True)
    calls = []
    forward = Q8Decoder.forward
    monkeypatch.setattr(Q8Decoder, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # decode in one OpenMP region needs a team, even on one core
    try:
        prompts, logits, seqs = _mixed_batch(loaded, loaded.config.vocab_size)
        assert isinstance(loaded.model.model.stack, Q8Decoder), "the C stack did not run"
        assert len(calls) >= STEPS, "the C stack ran no decode step"
        loaded.model.model.stack = False  # the per-module path, same weights and kernels
        _, module_logits, _ = _mixed_batch(loaded, loaded.config.vocab_size)
    finally:
        torch.set_num_threads(threads)
    for rid in seqs:
        assert torch.equal(logits[rid], module_logits[rid]), (name, rid)
    match_transformers(ref, prompts, logits, seqs, 1e-4)


def match_transformers(ref, prompts: dict[str, list[int]], logits: dict[str, torch.Tensor],
                       seqs: dict[str, list[int]], tol: float) -> None:
    """_mixed_batch's logits within `tol` relative error of transformers' model `ref` on each
    request's whole sequence, and its greedy tokens transformers' greedy ones."""
    for rid, seq in seqs.items():
        # the positions computed: all but the last token's (c's first block may have come
        # from the prefix cache)
        start = len(seq) - 1 - logits[rid].shape[0]
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0, start: start + logits[rid].shape[0]]
        assert rel_err(logits[rid], want) < tol, rid
        ours = seq[len(prompts[rid]):]
        gen = ref.generate(torch.tensor([prompts[rid]]), max_new_tokens=len(ours),
                           do_sample=False, pad_token_id=0)[0, len(prompts[rid]):].tolist()
        assert ours == gen, rid


def _sampling_rows(loaded) -> list[torch.Tensor]:
    """The model runner's call: a chunk where no row samples, the prompts' rest sampling their
    last rows (the last layer's MLP on those rows alone), two decode steps. Each step's logits
    by forward_logits and by the head module."""
    prompts = {"a": list(range(3, 23)), "b": list(range(40, 51))}
    batch = PagedBatch(loaded)
    batch.step({r: p[:6] for r, p in prompts.items()}, sample=[])
    out = batch.step({r: p[6:] for r, p in prompts.items()}, sample=list(prompts))
    got = [*batch.last]
    for _ in range(2):
        out = batch.step({r: [int(v[-1].argmax())] for r, v in out.items()},
                         sample=list(prompts))
        got += batch.last
    return got


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gemma2", "qwen3_5", "nemotron-h"])
def test_default_kernels_stack_matches_module_path(tmp_path, name) -> None:
    """With this CPU's default kernels (bf16 past 8 rows and VNNI for decode where it has
    them) the stack, prompts and decode in one OpenMP region (a hybrid's decode steps),
    gives the module path's bits, in a mixed batch and where only the sampling rows go past
    the last layer's attention (Gemma 2: the final-logit soft cap on the head the C call
    runs)."""
    require_cpu_kernels()
    loaded = load_model(resolve_model(str(make_tiny_model(name, tmp_path / name))), "float32",
                        quantization="int8")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, stack, _ = _mixed_batch(loaded, loaded.config.vocab_size)
        stack_rows = _sampling_rows(loaded)
        assert isinstance(loaded.model.model.stack, Q8Decoder)
        loaded.model.model.stack = False
        _, module, _ = _mixed_batch(loaded, loaded.config.vocab_size)
        module_rows = _sampling_rows(loaded)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(stack[r], module[r]) for r in stack)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(stack_rows, module_rows))
    cap = loaded.config.final_logit_softcapping
    if cap is not None:  # the C call's head logits (forward_logits') are capped
        assert max(rows.abs().max().item() for rows in stack_rows[::2]) <= cap


def test_stack_fills_the_rotary_tables_it_reads(tmp_path, monkeypatch) -> None:
    """A CPU rotary table is filled lazily (RotaryEmbedding.ensure): with 8 rows filled at load,
    the stack fills the rows its step reads (Gemma 3's two tables) and gives the logits of
    tables filled whole."""
    from loom.layers import rotary

    require_cpu_kernels()
    folder = make_tiny_model("gemma3", tmp_path / "gemma3")
    whole = load_model(resolve_model(str(folder)), "float32", quantization="int8")
    monkeypatch.setattr(rotary, "FIRST_ROWS", 8)
    lazy = load_model(resolve_model(str(folder)), "float32", quantization="int8")
    assert {r.filled for r in lazy.model.model.rotaries()} == {8}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (_, want, _), (_, got, _) = (_mixed_batch(m, m.config.vocab_size) for m in (whole, lazy))
    finally:
        torch.set_num_threads(threads)
    assert isinstance(lazy.model.model.stack, Q8Decoder)
    assert all(torch.equal(got[r], want[r]) for r in want)
