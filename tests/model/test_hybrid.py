"""Hybrid models (Qwen3.5: Gated DeltaNet linear attention beside attention; LFM2: short
convolutions beside attention; Granite 4.0-H: Mamba2 beside attention): the chunked forms of
the recurrences equal the token-by-token ones, Mamba2's C decode step equals its torch path,
and the engine's batches, chunked prefills, preemptions, multi-step decodes and reused state
slots give transformers' greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom import LLM, SamplingParams
from loom.layers import mamba2
from loom.layers.gated_delta import chunked, l2norm, recurrent_step
from loom.layers.recurrent import StepStates, state_bytes
from tests.tiny_models import make_tiny_chat_model, smollm2_tokenizer


def test_chunked_form_equals_the_recurrence() -> None:
    """150 tokens (three chunks, the last one padded) from a nonzero state: outputs and the
    final state equal the step-by-step recurrence's."""
    g = torch.Generator().manual_seed(0)
    n, heads, dk, dv = 150, 3, 16, 8
    q = l2norm(torch.randn(n, heads, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(n, heads, dk, generator=g))
    v = torch.randn(n, heads, dv, generator=g)
    decay = -torch.rand(n, heads, generator=g) * 0.3
    beta = torch.rand(n, heads, generator=g)
    start = torch.randn(heads, dk, dv, generator=g)
    state = start.clone()
    out = chunked(q, k, v, decay, beta, state)
    ref_state = start.clone()[None]
    ref = torch.stack([recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1],
                                      beta[t:t + 1], ref_state)[0] for t in range(n)])
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(state, ref_state[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(state, start, atol=1e-2)  # (the state moved)


def test_mamba2_chunked_form_equals_the_recurrence() -> None:
    """Mamba2's: 150 tokens (three chunks, the last one padded) from a nonzero state, B and C
    in two groups of two heads."""
    g = torch.Generator().manual_seed(0)
    n, heads, p, s = 150, 4, 8, 16
    x = torch.randn(n, heads, p, generator=g)
    dt = torch.rand(n, heads, generator=g) * 0.5
    a = -torch.rand(heads, generator=g) - 0.1
    b, c = torch.randn(n, 2, s, generator=g), torch.randn(n, 2, s, generator=g)
    start = torch.randn(heads, p, s, generator=g)
    state = start.clone()
    out = mamba2.chunked(x, dt, a, b, c, state)
    ref_state = start.clone()[None]
    group = torch.tensor([0, 0, 1, 1])
    ref = torch.stack([mamba2.recurrent_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1, group],
                                             c[t:t + 1, group], ref_state)[0]
                       for t in range(n)])
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(state, ref_state[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(state, start, atol=1e-2)


@pytest.fixture(scope="module", params=["qwen3_5", "lfm2", "granite4-h", "nemotron-h-moe"])
def hybrid(request, tmp_path_factory):
    tokenizer = smollm2_tokenizer()
    return make_tiny_chat_model(request.param, tmp_path_factory.mktemp(request.param),
                                tokenizer, vocab_size=len(tokenizer))


def test_engine_matches_transformers(hybrid) -> None:
    """Seven prompts of 3 to ~130 tokens, three running at a time (the state slots handed on),
    prefills cut into 32-token chunks beside decodes, a KV cache small enough to preempt (a
    resumed request starts from its kept states where its blocks are still cached), and
    multi-step decodes: each request's 24 greedy tokens are transformers' generate's."""
    from transformers import AutoModelForCausalLM

    tokenizer = smollm2_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 14
    prompts = [tokenizer.encode(text)[: 3 + 21 * r] for r in range(7)]
    llm = LLM(str(hybrid), dtype="float32", max_num_seqs=3, max_num_batched_tokens=32,
              num_gpu_blocks_override=14, num_scheduler_steps=4)
    assert llm.engine.runner.snapshots is not None  # (prefix caching: resumed requests hit)
    runner = llm.engine.runner  # one slot a running request; state_bytes says one's size
    held = sum(t.numel() * 4 for layer in runner.state_layers for t in layer.states)
    assert held == 3 * state_bytes(runner.model) > 0
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions_total > 0
    ref = AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == want, len(prompt)


# row_cost 0: a request drafts its k tokens whenever the lookup finds them, in any batch
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": None, "row_cost": 0.0}


def test_speculation_gives_the_same_greedy_tokens(hybrid) -> None:
    """Drafts from predictions (each request's reply with two tokens changed: drafts kept and
    rejected, the states then moved by the kept rows alone) and n-gram lookup, four requests
    at once in 32-token prefill chunks, one of them without drafts (logprobs), a cache small
    enough to preempt, and a repeated prompt (a prefix hit): each request's greedy tokens
    equal decoding one token at a time."""
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    prompts = [{"prompt_token_ids": ids[: 9 + 17 * r]} for r in range(5)]
    prompts.append(prompts[2])
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                             logprobs=1 if i == 3 else None) for i in range(len(prompts))]
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=12)
    want = [list(o.outputs[0].token_ids) for o in LLM(str(hybrid), **kw).generate(prompts, params)]
    for p, reply in zip(params, want):
        p.prediction = reply[:9] + [reply[9] + 1] + reply[10:20] + [reply[20] + 1] + reply[21:]
    llm = LLM(str(hybrid), speculative_config=NGRAM, **kw)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    stats = llm.engine.scheduler.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert got == want


def test_hybrid_draft_model(hybrid) -> None:
    """Each hybrid as its own draft model, three requests at once, one with a logit bias (its
    target's tokens then differ from the unbiased draft's: drafts rejected): the
    draft's states drop its rejected drafts (it starts each step from its kept states), and
    the greedy tokens equal decoding one token at a time."""
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    prompts = [{"prompt_token_ids": ids[: 5 + 9 * r]} for r in range(3)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                             logit_bias={ids[3]: 100.0} if r == 1 else None) for r in range(3)]
    want = [list(o.outputs[0].token_ids)
            for o in LLM(str(hybrid), dtype="float32").generate(prompts, params)]
    llm = LLM(str(hybrid), dtype="float32", speculative_config={
        "method": "draft_model", "model": str(hybrid), "num_speculative_tokens": 3,
        "disable_by_batch_size": None, "row_cost": 0.0})
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    stats = llm.engine.scheduler.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    drafter = llm.engine.scheduler.spec.drafter
    assert drafter.hybrid and not drafter.kept and not drafter.runner.snapshots.store
    assert got == want


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "granite4-h"])
def test_speculation_on_the_c_stack(tmp_path, name, monkeypatch) -> None:
    """int8 weights (batch-invariant kernels: a verify step's rows get one-row steps' bits):
    the one-call C stack runs the verify steps, each mixer's rows one after another on copies
    of the drafting requests' states, then commits the kept rows; greedy tokens equal
    decoding one token at a time."""
    from loom.attention.forward_context import get_forward_context
    from loom.models.q8_decoder import Q8Decoder
    from tests.cpu_kernels import require_cpu_kernels

    require_cpu_kernels()
    tokenizer = smollm2_tokenizer()
    folder = make_tiny_chat_model(name, tmp_path / name, tokenizer, vocab_size=len(tokenizer))
    verify_steps = []
    forward = Q8Decoder.forward
    monkeypatch.setattr(Q8Decoder, "forward", lambda *a, **k: verify_steps.append(
        get_forward_context().attn_metadata.state_dry is not None) or forward(*a, **k))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    prompts = [{"prompt_token_ids": ids[: 9 + 17 * r]} for r in range(3)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    kw = dict(dtype="float32", quantization="int8", batch_invariant=True)
    base = LLM(str(folder), **kw)
    assert not any(m.chunked for m in base.engine.runner.state_layers)  # (prompts: by token)
    want = [list(o.outputs[0].token_ids) for o in base.generate(prompts, params)]
    for p, reply in zip(params, want):
        p.prediction = reply[:7] + [reply[7] + 1] + reply[8:]
    verify_steps.clear()
    llm = LLM(str(folder), speculative_config=NGRAM, **kw)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert sum(verify_steps) > 0
    stats = llm.engine.scheduler.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert got == want
    # a second turn hits the prefix cache up to the reply's last boundary: its states were
    # kept mid-step, where a verify step's kept rows passed it
    second = prompts[1]["prompt_token_ids"] + want[1] + tokenizer.encode(" And then?")
    cache = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    hits = cache.hits
    turn = [{"prompt_token_ids": second}], SamplingParams(max_tokens=8, temperature=0.0)
    again = llm.generate(*turn)[0].outputs[0].token_ids
    assert cache.hits - hits == (26 + 24 - 1) // 16 * 16
    assert list(again) == list(base.generate(*turn)[0].outputs[0].token_ids)


def test_prefix_hits_start_from_the_kept_states(hybrid) -> None:
    """A second turn (the first turn's prompt and reply, then more) hits the prefix cache up
    to the last block boundary whose states were kept, its slot starts from them, and its
    greedy tokens are transformers'; a request cut off mid-prompt before a kept boundary
    falls back to a shorter hit."""
    from transformers import AutoModelForCausalLM

    tokenizer = smollm2_tokenizer()
    text = "Tell me about the quick brown fox and the lazy dog, please. " * 6
    first = tokenizer.encode(text)[:53]
    llm = LLM(str(hybrid), dtype="float32", max_num_batched_tokens=64)
    assert llm.engine.scheduler.kv_cache_manager.enable_caching
    kernels = llm.engine.loaded.kernels is not None  # prompts in the C chunkwise form
    assert all(m.chunked == kernels for m in llm.engine.runner.state_layers)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reply = llm.generate([{"prompt_token_ids": first}], params)[0].outputs[0].token_ids
    second = first + list(reply) + tokenizer.encode(" And then?")
    stats = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    hits = stats.hits
    out = llm.generate([{"prompt_token_ids": second}], params)[0]
    assert stats.hits - hits == (len(first) + len(reply) - 1) // 16 * 16  # the last boundary
    ref = AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32)
    with torch.no_grad():
        want = ref.generate(torch.tensor([second]), max_new_tokens=20, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(second):].tolist()
    assert list(out.outputs[0].token_ids) == want


def _check_c_decode_step(mixer, width: int, g: torch.Generator) -> None:
    """Five steps of three one-token requests in slots 4, 0 and 2 of 6, from random states:
    the C decode step's outputs and states equal _torch's; the other slots untouched."""
    mixer.allocate_states(6, torch.device("cpu"))
    mixer.states = [torch.randn(t.shape, generator=g) for t in mixer.states]
    start = [t.clone() for t in mixer.states]
    ref_states = [t.clone() for t in mixer.states]
    starts, lens, slots = np.arange(4), np.ones(3, dtype=np.int64), np.array([4, 0, 2])
    with torch.no_grad():
        for _ in range(5):
            proj = torch.randn(3, width, generator=g)
            got = mixer._fused(proj, StepStates(starts, lens, slots, mixer.states))
            want = mixer._torch(proj, StepStates(starts, lens, slots, ref_states))
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            for t, ref in zip(mixer.states, ref_states):
                assert torch.allclose(t, ref, rtol=1e-5, atol=1e-5)
    for t, first in zip(mixer.states, start):  # the other slots untouched, these moved
        assert torch.equal(t[[1, 3, 5]], first[[1, 3, 5]])
        assert not torch.allclose(t[[4, 0, 2]], first[[4, 0, 2]], atol=1e-2)


def _check_verify_rows(mixer, width: int, g: torch.Generator) -> None:
    """A verify step: requests of 5, 1 and 3 rows in slots 4, 0 and 2, the first and last dry
    (their rows on copies of their states), then a commit of their first 2 and 3 rows: the C
    decode step's outputs and states are the bits of one-row steps (slot 0 moved by its row,
    slots 4 and 2 by their kept rows, the others untouched); the torch path's the same within
    rounding."""
    mixer.allocate_states(6, torch.device("cpu"))
    mixer.states = [torch.randn(t.shape, generator=g) for t in mixer.states]
    start = [t.clone() for t in mixer.states]
    starts, slots = np.array([0, 5, 6, 9]), np.array([4, 0, 2])
    dry = np.array([1, 0, 1], dtype=np.int8)
    proj = torch.randn(9, width, generator=g)
    with torch.no_grad():
        one_rows, after = [], {}  # one-row steps, and each slot's states after its kept rows
        for r, slot in enumerate(slots):
            for i, row in enumerate(range(starts[r], starts[r + 1])):
                step = StepStates(np.arange(2), np.ones(1, dtype=np.int64), slots[r:r + 1],
                                  mixer.states)
                one_rows.append(mixer._fused(proj[row:row + 1], step))
                if i + 1 == (2, 1, 3)[r]:
                    after[int(slot)] = [t[slot].clone() for t in mixer.states]
        for t, first in zip(mixer.states, start):
            t.copy_(first)
        step = StepStates(starts, np.diff(starts), slots, mixer.states, dry)
        got = mixer.mix_rows(proj, step)
        assert torch.equal(got, torch.cat(one_rows))
        for t, first, i in zip(mixer.states, start, range(2)):
            assert torch.equal(t[[4, 2, 1, 3, 5]], first[[4, 2, 1, 3, 5]])  # dry: untouched
            assert torch.equal(t[0], after[0][i])
        mixer.commit(np.zeros(2, dtype=np.int64), np.array([1, 1]))
        mixer.commit(np.array([1, 1]), np.array([2, 3]))  # (in two parts: the same)
        for t, first, i in zip(mixer.states, start, range(2)):
            assert torch.equal(t[4], after[4][i]) and torch.equal(t[2], after[2][i])
            assert torch.equal(t[[1, 3, 5]], first[[1, 3, 5]])
        for t, first in zip(mixer.states, start):  # the torch path, from the same start
            t.copy_(first)
        got = mixer._torch_dry(proj, step)
        assert torch.allclose(got, torch.cat(one_rows), rtol=1e-4, atol=1e-4)
        for t, first, i in zip(mixer.states, start, range(2)):
            assert torch.equal(t[[4, 2]], first[[4, 2]])
            assert torch.allclose(t[0], after[0][i], rtol=1e-5, atol=1e-5)


def _check_prompt_rows(mixer, width: int, g: torch.Generator) -> None:
    """Prompts' runs of 21, 3, 9 and 1 rows in slots 3, 0, 2 and 1 of 5: the C step's
    chunkwise form (`chunked`: runs of 4 rows or more, 8 at a time: full chunks, a part
    chunk, a run too short to chunk) gives the token-by-token form's outputs and states and
    _torch's within rounding, with its own bits (it ran); slot 4 untouched."""
    mixer.allocate_states(5, torch.device("cpu"))
    start = [torch.randn(t.shape, generator=g) * 0.3 for t in mixer.states]
    starts, slots = np.array([0, 21, 24, 33, 34]), np.array([3, 0, 2, 1])
    step = StepStates(starts, np.diff(starts), slots, mixer.states)
    proj = torch.randn(34, width, generator=g)
    got = {}
    with torch.no_grad():
        for form in ("chunked", "tokens", "torch"):
            for t, first in zip(mixer.states, start):
                t.copy_(first)
            mixer.chunked = form == "chunked"
            y = mixer._torch(proj, step) if form == "torch" else mixer._fused(proj, step)
            got[form] = (y, [t.clone() for t in mixer.states])
    y, states = got["chunked"]
    for form in ("tokens", "torch"):
        assert torch.allclose(y, got[form][0], rtol=1e-4, atol=1e-4)
        for t, ref in zip(states, got[form][1]):
            assert torch.allclose(t, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(y[:21], got["tokens"][0][:21])  # the chunkwise form ran
    assert torch.equal(y[33], got["tokens"][0][33])  # (one row: token by token)
    for t, first in zip(states, start):
        assert torch.equal(t[4], first[4])


def test_gdn_c_decode_step_equals_the_torch_path() -> None:
    """Gated DeltaNet's C decode step (csrc/gated_delta.c) against _torch: two value heads a
    key head, width 4; then heads 24 wide (a vector and a part one) for prompts."""
    from loom.config import LinearAttnConfig
    from loom.layers.gated_delta import GatedDeltaNet
    from tests.cpu_kernels import require_cpu_kernels

    require_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    mixer = GatedDeltaNet(64, LinearAttnConfig(2, 4, 16, 8, 4), 1e-6)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    width = mixer.conv_dim + mixer.value_dim + 2 * 4
    _check_c_decode_step(mixer, width, g)
    _check_verify_rows(mixer, width, g)
    mixer = GatedDeltaNet(64, LinearAttnConfig(2, 4, 32, 24, 4), 1e-6)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    _check_prompt_rows(mixer, mixer.conv_dim + mixer.value_dim + 2 * 4, g)


def test_mamba2_c_decode_step_equals_the_torch_path() -> None:
    """Mamba2's C decode step (csrc/mamba2.c) against _torch: groups of heads sharing B and C,
    a conv bias, two norm groups, dt clamped below; then heads 24 wide (a vector and a part
    one) and states of 20 for prompts."""
    from loom.config import MambaConfig
    from tests.cpu_kernels import require_cpu_kernels

    require_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    shape = MambaConfig(num_heads=8, head_dim=16, state_size=16, num_groups=2, conv_kernel=4,
                        conv_bias=True, norm_groups=2, time_step_min=0.01)
    mixer = mamba2.Mamba2Mixer(64, shape, 1e-5)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
        mixer.dt_bias[::2] = -6.0  # (these heads' dt mostly clamped to time_step_min)
    _check_c_decode_step(mixer, mixer.inner + mixer.conv_dim + shape.num_heads, g)
    _check_verify_rows(mixer, mixer.inner + mixer.conv_dim + shape.num_heads, g)
    shape = MambaConfig(num_heads=6, head_dim=24, state_size=20, num_groups=3, conv_kernel=4,
                        conv_bias=False, norm_groups=1)
    mixer = mamba2.Mamba2Mixer(64, shape, 1e-5)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    _check_prompt_rows(mixer, mixer.inner + mixer.conv_dim + shape.num_heads, g)


def test_shortconv_c_decode_step_equals_the_torch_path() -> None:
    """LFM2's short convolution's C decode step (csrc/shortconv.c) against _torch: a conv
    bias, width 3."""
    from loom.layers.recurrent import ShortConv
    from tests.cpu_kernels import require_cpu_kernels

    require_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    mixer = ShortConv(64, 3, bias=True)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    _check_c_decode_step(mixer, 3 * 64, g)
    _check_verify_rows(mixer, 3 * 64, g)


def test_a_reply_keeps_only_its_newest_states(hybrid) -> None:
    """Past its prompt a request keeps only the states at its newest block boundary (each new
    one replaces the last): a 20-token prompt and 60 tokens out keep the prompt's last
    boundary's states (16) and the reply's newest (64), not 32 and 48 too."""
    llm = LLM(str(hybrid), dtype="float32")
    snapshots = llm.engine.runner.snapshots
    prompt = smollm2_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 4)
    llm.generate([{"prompt_token_ids": prompt[:20]}],
                 SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    assert len(snapshots.store) == 2


def test_state_snapshots_pool() -> None:
    """StateSnapshots keeps up to budget // one request's states copies: a restore gives back
    the saved states bit for bit, the oldest used goes first when room is needed (a demoted one
    before any other), a dropped copy's room is taken again (the lowest first, no new one
    allocated), and a budget under one request's states keeps nothing."""
    from types import SimpleNamespace

    from loom.layers.recurrent import StateSnapshots

    g = torch.Generator().manual_seed(0)
    layer = SimpleNamespace(states=[torch.randn(4, 2, 3, generator=g),
                                    torch.randn(4, 5, generator=g)])
    per = 4 * (6 + 5)
    snaps = StateSnapshots([layer], 3 * per + per - 1)
    assert snaps.capacity == 3 and not snaps.entries
    before = [t.clone() for t in layer.states]
    for key, slot in (("a", 0), ("b", 1), ("c", 2)):
        snaps.save(key, slot)
    assert [snaps.store[k] for k in "abc"] == [0, 1, 2]
    assert [tuple(t.shape) for t in snaps.entries[2]] == [(2, 3), (5,)]
    for t in layer.states:
        t.normal_(generator=g)
    snaps.restore("a", 3)  # "a" used: "b" is now the oldest
    assert all(torch.equal(t[3], b[0]) for t, b in zip(layer.states, before))
    snaps.demote("c")
    snaps.save("d", 1)  # room from the demoted "c", not the oldest "b"
    assert "c" not in snaps and list(snaps.store) == ["b", "a", "d"] and snaps.store["d"] == 2
    snaps.restore("b", 0)
    assert all(torch.equal(t[0], b[1]) for t, b in zip(layer.states, before))
    snaps.save("e", 2)  # no demoted one: the oldest used ("a") goes
    assert list(snaps.store) == ["d", "b", "e"] and snaps.store["e"] == 0
    snaps.drop("b")
    snaps.drop("e")
    snaps.save("f", 3)
    assert snaps.store["f"] == 0 and len(snaps.entries) == 3  # the lowest free entry
    assert all(torch.equal(e, t[3]) for e, t in zip(snaps.entries[0], layer.states))
    assert StateSnapshots([layer], per - 1).capacity == 0


def test_state_cache_memory_bounds_the_kept_states(hybrid) -> None:
    """--state-cache-memory sets how many requests' states prefix caching keeps (by default
    256 MiB, at least 8 requests'). With room for two, two conversations' first turns one
    after the other keep both replies' newest states: a prompt's go first once its request
    has a reply's (the oldest used, the first reply's, would go otherwise), so the first
    conversation's second turn hits its whole first turn; 0 keeps none (no hit, the same
    tokens)."""
    from loom.engine.llm_engine import STATE_CACHE_BYTES, STATE_CACHE_MIN_ENTRIES

    llm = LLM(str(hybrid), dtype="float32")
    per = state_bytes(llm.engine.loaded.model)
    assert llm.engine.runner.snapshots.capacity == max(
        STATE_CACHE_BYTES, STATE_CACHE_MIN_ENTRIES * per) // per
    tokenizer = smollm2_tokenizer()
    words = tokenizer.encode(" ".join(f"w{i}" for i in range(200)))
    firsts = [words[:40], words[50:90]]  # prompt states at 32, replies' newest at 64
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(str(hybrid), dtype="float32", state_cache_memory=2 * per + per // 2)
    snapshots, stats = llm.engine.runner.snapshots, \
        llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    assert snapshots.capacity == 2
    reply = [list(llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids)
             for p in firsts][0]
    assert len(snapshots.store) == 2 and not snapshots.demoted
    second = firsts[0] + reply + tokenizer.encode(" And then?")
    hits = stats.hits
    out = llm.generate([{"prompt_token_ids": second}], params)[0].outputs[0].token_ids
    assert stats.hits - hits == 64
    none = LLM(str(hybrid), dtype="float32", state_cache_memory=0)
    assert none.engine.runner.snapshots is None
    got = none.generate([{"prompt_token_ids": second}], params)[0].outputs[0].token_ids
    assert list(got) == list(out)
    assert none.engine.scheduler.kv_cache_manager.prefix_cache_stats.hits == 0
