"""LLMEngine / LLM equivalences: prefix cache, chunked prefill, batching, preemption, seeds,
n > 1 block sharing, aborts. Every pair must produce identical tokens."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from loom import SamplingParams
from loom.config import ConfigError
from loom.engine.llm_engine import InvalidRequestError
from loom.worker.kv_cache import row_width
from tests.cpu_kernels import require_amx, require_bf16, require_vnni
from tests.engine_fixtures import make_llm, tiny_model_with_tokenizer  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

SYSTEM = ("You are a careful assistant. Answer in one short sentence, and never invent facts. "
          "If you do not know, say so plainly.")
QUESTIONS = [
    "What is the capital of France?", "Name a prime number.", "What colour is the sky?",
    "How many legs does a spider have?", "What is water made of?", "Who wrote Hamlet?",
    "What is 2 + 2?", "Name a planet.", "What do bees make?", "What is the largest ocean?",
    "Say hello.", "Give me a fruit.", "Which animal barks?", "What is ice?",
    "What is the opposite of hot?", "Count to three.",
]


def chats() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS]


def token_ids(outputs) -> list[list[int]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny")))


def _tiny_prompts(n: int, length: int = 40) -> list[list[int]]:
    import random

    rng = random.Random(0)
    shared = [rng.randrange(3, 256) for _ in range(length // 2)]
    return [shared + [rng.randrange(3, 256) for _ in range(length // 2 + i)] for i in range(n)]


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_prefix_cache_on_vs_off(make_llm, tiny, model) -> None:
    name = tiny if model == "tiny" else None
    def run(enable: bool):
        llm = make_llm(name, enable_prefix_caching=enable)
        if model == "tiny":
            outs = llm.generate(_tiny_prompts(8), GREEDY, use_tqdm=False)
        else:
            outs = llm.chat(chats()[:8], GREEDY, use_tqdm=False)
        llm.engine.check_integrity()
        return token_ids(outs), llm.engine.scheduler.prefix_cache_stats.hits
    on, hits_on = run(True)
    off, hits_off = run(False)
    assert on == off
    assert hits_on > 0 and hits_off == 0


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_chunked_vs_whole_prefill(make_llm, tiny, model) -> None:
    name = tiny if model == "tiny" else None
    def run(budget: int):
        llm = make_llm(name, max_num_batched_tokens=budget, enable_prefix_caching=False)
        if model == "tiny":
            outs = llm.generate(_tiny_prompts(6, 60), GREEDY, use_tqdm=False)
        else:
            outs = llm.chat(chats()[:6], GREEDY, use_tqdm=False)
        llm.engine.check_integrity()
        return token_ids(outs)
    assert run(13) == run(2048)


# int4 is left out: its kernel (bf16 activations) sums a row differently in a batch than alone,
# so near-ties can flip (seen on the second of these prompts).
@pytest.mark.parametrize("quantization", ["none", "fp16", "int8"])
@pytest.mark.slow
def test_batched_vs_alone_smollm2(make_llm, quantization) -> None:
    unique = [f"{q} Answer:" for q in QUESTIONS]
    prompts = unique * 2  # 32 requests, each prompt twice
    llm = make_llm(None, quantization=quantization)
    batched = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in unique]
    assert batched == alone * 2
    llm.engine.check_integrity()


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_preemption_with_a_tiny_cache_loses_nothing(make_llm, tiny, model) -> None:
    """Greedy and seeded sampled requests give the same tokens when preempted (recomputed)
    as without: a seeded request's generator goes on from where it stopped (the fuzzing of a
    small cache found seeded replies that changed after a preemption, its draws restarted)."""
    name = tiny if model == "tiny" else None
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [greedy if i % 2 else greedy.clone(temperature=1.0, seed=i) for i in range(8)]
    params[5] = params[7] = greedy.clone(prompt_logprobs=1)  # scored once, however recomputed
    def run(blocks: int | None):
        llm = make_llm(name, num_gpu_blocks_override=blocks, enable_prefix_caching=False)
        if model == "tiny":
            outs = llm.generate(_tiny_prompts(8, 30), params, use_tqdm=False)
        else:
            outs = llm.chat(chats()[:8], params, use_tqdm=False)
        llm.engine.check_integrity()
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
        scores = [[None if p is None else p.logprobs for p in o.prompt_logprobs]
                  for o in outs if o.prompt_logprobs is not None]
        assert [len(s) for s in scores] == [len(outs[i].prompt_token_ids) for i in (5, 7)]
        return token_ids(outs), scores, llm.engine.scheduler.num_preemptions_total
    small, small_scores, preemptions = run(14 if model == "tiny" else 20)
    ample, ample_scores, none = run(None)
    assert small == ample
    for got, want in zip(small_scores, ample_scores):
        assert got[0] is None and want[0] is None
        assert sum(got[1:], []) == pytest.approx(sum(want[1:], []), abs=1e-4)
    assert preemptions > 0 and none == 0


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_decode_steps_ahead_give_the_same_tokens(make_llm, tiny, model) -> None:
    """num_scheduler_steps 4 (the CPU's default: up to 3 decode steps ahead in one runner call)
    gives the tokens of one step at a time: requests stopping on a stop token inside a step
    ahead, one asking for logprobs (no steps ahead while it runs), max_tokens reached inside
    them, with preemptions from a small cache."""
    name = tiny if model == "tiny" else None
    plain = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)

    def run(steps: int, params: list[SamplingParams], blocks: int | None = None):
        llm = make_llm(name, num_scheduler_steps=steps, num_gpu_blocks_override=blocks,
                       enable_prefix_caching=False)
        ahead = []
        decode_ahead = llm.engine.runner._decode_ahead
        llm.engine.runner._decode_ahead = lambda n, *a: (ahead.append(n), decode_ahead(n, *a))
        prompts = _tiny_prompts(6, 30) if model == "tiny" else chats()[:6]
        outs = (llm.generate(prompts, params, use_tqdm=False) if model == "tiny"
                else llm.chat(prompts, params, use_tqdm=False))
        llm.engine.check_integrity()
        return ([token_ids(outs), [o.outputs[0].text for o in outs]], ahead,
                llm.engine.scheduler.num_preemptions_total)

    (ref, texts), ahead, _ = run(1, [plain] * 6)
    assert not ahead
    params = [plain.clone(stop_token_ids=[ref[i][0][6 + i]]) if i % 2 else plain
              for i in range(6)]
    params[4] = plain.clone(max_tokens=10 + 4, logprobs=0)
    if model != "tiny":  # a stop string (the tiny model's text is mostly broken UTF-8)
        params[2] = plain.clone(stop=[texts[2][len(texts[2]) // 2:][:3]])
    expected, _, _ = run(1, params)
    if model != "tiny":
        assert len(expected[0][2][0]) < len(ref[2][0]) and expected[1][2] in texts[2]
    for blocks in (None, 14 if model == "tiny" else 20):
        got, ahead, preempted = run(4, params, blocks)
        assert got == expected
        assert (preempted > 0) == (blocks is not None)
        if blocks is None:  # (a small cache's steps often lack the blocks for steps ahead)
            assert max(ahead) == 3


@pytest.mark.slow
def test_stop_string_before_the_last_rule_of_a_step_ahead(make_llm) -> None:
    """A stop string completed at a token before the one where max_tokens or a stop token
    ends the same multi-token step (steps ahead here; accepted drafts alike) stops the request
    there, as one token a step does: the fuzzing of steps 1 against 8 found 'length' with the
    tokens past the string kept."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [[{"role": "user", "content": "Count from one to twenty in words."}]]
    one = make_llm(None, num_scheduler_steps=1, enable_prefix_caching=False)
    ref = one.chat(prompt, plain, use_tqdm=False)[0].outputs[0]
    tokens = list(ref.token_ids)
    cut = len(one.get_tokenizer().decode(tokens[:3]))  # the stop string ends in token 3 or 4
    stop = ref.text[cut - 1:cut + 1]
    assert stop and stop in ref.text
    cases = [plain.clone(max_tokens=8, stop=[stop]),
             plain.clone(stop=[stop], stop_token_ids=[tokens[7]]),
             plain.clone(max_tokens=8, stop=[stop], include_stop_str_in_output=True)]
    want = [o.outputs[0] for o in one.chat(prompt * 3, cases, use_tqdm=False)]
    assert all(w.finish_reason == "stop" and w.stop_reason == stop and len(w.token_ids) < 8
               for w in want)
    ahead = make_llm(None, num_scheduler_steps=8, enable_prefix_caching=False)
    steps = []
    decode_ahead = ahead.engine.runner._decode_ahead
    ahead.engine.runner._decode_ahead = lambda n, *a: (steps.append(n), decode_ahead(n, *a))
    got = [o.outputs[0] for o in ahead.chat(prompt * 3, cases, use_tqdm=False)]
    assert steps  # the tokens came in steps ahead
    for g, w in zip(got, want):
        assert (list(g.token_ids), g.text, g.finish_reason, g.stop_reason) == (
            list(w.token_ids), w.text, w.finish_reason, w.stop_reason)


@pytest.mark.slow
def test_the_stop_tokens_text_stays_out_of_the_output(make_llm) -> None:
    """vLLM's rule: the token that stopped a request (EOS, a stop_token_ids entry) adds no text
    unless include_stop_str_in_output; its id stays in token_ids. Seen with skip_special_tokens
    off (the tool parsers keep special markers so): the text ended in `<|im_end|>`."""
    llm = make_llm(None)
    eos = llm.get_tokenizer().encode("<|im_end|>", add_special_tokens=False)
    prompt = [[{"role": "user", "content": "Say hi"}]]
    plain = SamplingParams(temperature=0.0, max_tokens=40, skip_special_tokens=False)
    cases = [plain, plain.clone(include_stop_str_in_output=True)]
    free = llm.chat(prompt, cases[0], use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and list(free.token_ids[-1:]) == eos
    second = free.token_ids[1]  # a plain token as the stop token
    cases += [plain.clone(stop_token_ids=[second]),
              plain.clone(stop_token_ids=[second], include_stop_str_in_output=True)]
    outs = [o.outputs[0] for o in llm.chat(prompt * 4, cases, use_tqdm=False)]
    tok = llm.get_tokenizer()
    assert outs[0].text == tok.decode(free.token_ids[:-1], skip_special_tokens=False)
    assert outs[1].text == outs[0].text + "<|im_end|>"
    assert list(outs[2].token_ids) == list(free.token_ids[:2]) and outs[2].stop_reason == second
    assert outs[2].text == tok.decode(free.token_ids[:1], skip_special_tokens=False)
    assert outs[3].text == tok.decode(free.token_ids[:2], skip_special_tokens=False)


@pytest.mark.slow
def test_repeated_greedy_request_same_with_the_prefix_cache(make_llm) -> None:
    """Loom's default kernels (not batch-invariant: a step of up to 8 rows runs the decode
    kernels, of more the batch kernels, other bits): a greedy request repeated is answered
    from the prefix cache with the tokens of its first run, because a hit leaves more rows to
    compute than the small-step kernels take (KVCacheManager.min_new_tokens). Without that rule
    this 49-token prompt hit 48 cached tokens, its last one ran on the decode kernel and the
    reply changed from its first token (the packaged model on a Zen 4, bf16 build)."""
    code = "def add(a, b):\n    return a + b\n"
    messages = [{"role": "user", "content": "Repeat this code exactly:\n" + code}]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    llm = make_llm(None, batch_invariant=False)
    kv = llm.engine.scheduler.kv_cache_manager
    first = llm.chat(messages, params, use_tqdm=False)[0]
    again = llm.chat(messages, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    if kv.min_new_tokens:  # kernels whose bits change with the rows: the tail ran on the others
        assert len(first.prompt_token_ids) - again.num_cached_tokens >= kv.min_new_tokens


@pytest.mark.slow
def test_seed_reproducible_whatever_the_batch(make_llm) -> None:
    llm = make_llm(None)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = llm.generate(["Tell me a story about a cat."], seeded, use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=30), GREEDY,
              SamplingParams(temperature=0.7, seed=7, max_tokens=10)]
    mixed = llm.generate(
        ["Hi", "Tell me a story about a cat.", "Why is the sea blue?", "List three colours"],
        [others[0], seeded, others[1], others[2]], use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = llm.generate(["Tell me a story about a cat."], seeded.clone(seed=99),
                              use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


@pytest.mark.slow
def test_n4_shares_prompt_blocks(make_llm) -> None:
    llm = make_llm(None)
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    prompt = engine.tokenizer.encode(SYSTEM * 3)  # several full blocks
    full_blocks = len(prompt) // 16
    free_before = kv.num_free_blocks
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=8))
    engine.step()
    used = free_before - kv.num_free_blocks
    per_request = -(-(len(prompt) + 1) // 16)
    # Four samples hold the prompt's full blocks once, plus their own partial block.
    assert used == full_blocks + 4 * (per_request - full_blocks)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs) == 4
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1  # distinct samples
    engine.check_integrity()


@pytest.mark.slow
def test_abort_frees_blocks(make_llm) -> None:
    llm = make_llm(None, enable_prefix_caching=False)
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    free = kv.num_free_blocks
    engine.add_request("long", "Write a long essay about the ocean.",
                       SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("short", "Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert kv.num_free_blocks < free
    engine.abort_request("long")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    reasons = {o.request_id: o.outputs[0].finish_reason for o in outs if o.finished}
    assert reasons == {"long": "abort", "short": "length"}
    assert kv.num_free_blocks == free
    engine.check_integrity()


@pytest.mark.slow
def test_shared_system_prompt_hits_the_prefix_cache(make_llm) -> None:
    llm = make_llm(None)
    stats = llm.engine.scheduler.prefix_cache_stats
    llm.chat(chats()[0], GREEDY, use_tqdm=False)
    hits_before = stats.hits
    out = llm.chat(chats()[1], GREEDY, use_tqdm=False)[0]
    system_tokens = len(llm.get_tokenizer().encode(SYSTEM))
    assert stats.hits - hits_before >= (system_tokens // 16) * 16 > 0
    assert out.num_cached_tokens >= 16


@pytest.mark.slow
def test_chat_continues_a_final_message(make_llm) -> None:
    """LLM.chat(continue_final_message=True): the prompt ends inside the last message (no end
    of turn), and generation continues it: the same tokens as generate() on that prompt."""
    llm = make_llm(None)
    conv = [*chats()[0], {"role": "assistant", "content": "The first step is"}]
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv, GREEDY, continue_final_message=True, use_tqdm=False)
    out = llm.chat(conv, GREEDY, add_generation_prompt=False, continue_final_message=True,
                   chat_template_kwargs={"unused": 1}, use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids).endswith("The first step is")
    again = llm.generate(out.prompt_token_ids, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


@pytest.mark.slow
def test_stops_logprobs_and_finish_reasons(make_llm) -> None:
    llm = make_llm(None)
    prompt = "Count: 1, 2, 3, 4,"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string greedy decoding surely produces
    assert len(stop) == 3
    out = llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=30, stop=[stop], logprobs=3, prompt_logprobs=2),
        use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    assert len(c.logprobs) == len(c.token_ids)
    assert all(len(lp.token_ids) == 4 and lp.token_ids[0] == t
               for lp, t in zip(c.logprobs, c.token_ids))
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    # A chat reply ends with the model's EOS (<|im_end|>): finish "stop" without a stop_reason.
    eos = llm.chat([{"role": "user", "content": "Say hi."}],
                   SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    assert eos.outputs[0].finish_reason == "stop" and eos.outputs[0].stop_reason is None
    assert eos.outputs[0].token_ids[-1] in llm.engine.eos_token_ids


@pytest.mark.slow
def test_bad_requests_are_rejected_clearly(make_llm) -> None:
    llm = make_llm(None, max_model_len=64)
    # the default KV size keeps one context of idle prefix history resident on the CPU
    assert llm.engine.scheduler.kv_cache_manager.block_pool.resident_blocks == 64 // 16
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate("word " * 100, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len"):
        llm.generate("Hello", SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.generate([[10**7]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="must be integers"):
        llm.generate([["Hello", "world"]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="not float"):
        llm.generate([1.5], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {}}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # vLLM's prompt dicts and numpy ids are the same prompts as a string and a list
    params = SamplingParams(temperature=0, max_tokens=4)
    plain = llm.generate("Hello", params, use_tqdm=False)[0]
    ids = plain.prompt_token_ids
    forms = [{"prompt": "Hello"}, {"prompt_token_ids": ids}, np.array(ids)]
    for out in llm.generate(forms, params, use_tqdm=False):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    llm.engine.check_integrity()


def test_priority_policy_serves_better_ranks_first_and_keeps_the_tokens(make_llm, tiny) -> None:
    """vLLM's priority scheduling: with two sequences at a time, requests start in (priority,
    arrival) order, a better-ranked arrival preempts the worst-ranked running request, and
    every request's greedy tokens are those an FCFS engine gives. FCFS refuses a priority."""
    prompts = _tiny_prompts(6, 30)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fcfs = make_llm(tiny)
    want = token_ids(fcfs.generate(prompts, params, use_tqdm=False))
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as e:
        fcfs.generate(prompts[:1], params, use_tqdm=False, priority=[1])
    assert e.value.param == "priority"
    assert not fcfs.engine.has_unfinished_requests()

    llm = make_llm(tiny, scheduling_policy="priority", max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="must be an integer"):
        llm.generate(prompts[:1], params, use_tqdm=False, priority=[True])
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts[:2], params, use_tqdm=False, priority=[0])
    engine = llm.engine
    ranks = [3, 5, 0, 1, 3]
    for i, rank in enumerate(ranks):
        engine.add_request(f"r{i}", prompts[i], params, priority=rank)
    started: list[str] = []
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 4:  # r2 and r3 run: the best rank arrives and preempts r3 (rank 1)
            engine.add_request("r5", prompts[5], params, priority=-1)
        for out in engine.step():
            if out.request_id not in started:
                started.append(out.request_id)
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    assert started == ["r2", "r3", "r5", "r0", "r4", "r1"]
    assert engine.scheduler.num_preemptions_total == 1
    assert [got[f"r{i}"] for i in range(6)] == [w[0] for w in want]
    engine.check_integrity()


@pytest.mark.slow
def test_allowed_tokens_bad_words_and_truncation(make_llm) -> None:
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens on the packaged model,
    greedy: a banned word the free reply holds is gone (alone and with n-gram drafts, which
    check each draft against the bans), only allowed ids come out, and a truncated prompt
    answers as its last N tokens given alone."""
    llm = make_llm(None, max_model_len=256)
    prompt = "The capital of France is"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0]
    assert "Paris" in free.text
    banned = SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris", "the capital"])
    out = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text and "the capital" not in out.text and out.text != free.text
    ids = llm.engine._bad_words_ids(["Paris"])  # as written and after a space
    assert [len(i) for i in ids] == [1, 1] and ids[0] != ids[1]
    allowed = [free.token_ids[1], free.token_ids[3], 30]
    only = llm.generate(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=12,
                                               allowed_token_ids=allowed), use_tqdm=False)
    assert set(only[0].outputs[0].token_ids) <= set(allowed)
    long = "one two three four five six seven eight nine ten. " + prompt
    full = llm.get_tokenizer().encode(long)
    cut = llm.generate(long, SamplingParams(temperature=0, max_tokens=8,
                                            truncate_prompt_tokens=6), use_tqdm=False)[0]
    alone = llm.generate([full[-6:]], SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)[0]
    assert cut.prompt_token_ids == full[-6:] and cut.prompt is None
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    fits = llm.generate(long * 40, SamplingParams(temperature=0, max_tokens=4,
                                                   truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(fits.prompt_token_ids) == llm.engine.scheduler_config.max_model_len - 4
    spec = make_llm(None, max_model_len=256,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    quote = "Repeat: the capital of France is Paris, the capital of France is Paris."
    want = llm.generate(quote, banned, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.generate(quote, banned, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("quantization", ["none", "int8"])  # module path; int8's one-call stack
@pytest.mark.parametrize("kv,row_bytes,min_same", [("float16", 128, 5), ("int8", 80, 4)])
@pytest.mark.slow
def test_smaller_kv_cache_holds_more_blocks_and_keeps_the_answers(
    make_llm, quantization, kv, row_bytes, min_same
) -> None:
    """--kv-cache-dtype float16 / int8 on the default model against the fp32 cache (256 bytes
    a head row): more blocks in the same bytes (fp16: 128 bytes a row; int8: 64 values, 2 fp32
    scales and 2 minimums, 80), and greedy answers that mostly match (K/V rounded; attention in
    fp32; int8's top-1 agreement is measured in tests/model/test_quant.py)."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    runs = {}
    for name in ("float32", kv):
        llm = make_llm(None, kv_cache_memory=64 * 2**20, kv_cache_dtype=name,
                       quantization=quantization)
        runs[name] = (llm.engine.num_blocks,
                      token_ids(llm.chat(chats()[:6], params, use_tqdm=False)))
        assert llm.engine.runner.kv_caches[0].dtype == getattr(torch, name)
        llm.engine.check_integrity()
    per_block = 2 * 30 * 16 * 3  # K and V, layers, block size, kv heads
    assert runs["float32"][0] == 64 * 2**20 // (per_block * 256)
    assert runs[kv][0] == 64 * 2**20 // (per_block * row_bytes)
    same = sum(a == b for a, b in zip(runs["float32"][1], runs[kv][1]))
    assert same >= min_same, same


def _int8_answers(make_llm, kernels: str, num_chats: int) -> list[list[list[int]]]:
    """Greedy 24-token answers to the first `num_chats` chats from an int8 engine (fp32 KV
    cache) on --cpu-kernels `kernels` ("fp32": batch-invariant); the engine's blocks are all
    returned afterwards."""
    args = ({"batch_invariant": True} if kernels == "fp32"
            else {"cpu_kernels": kernels, "batch_invariant": False})
    llm = make_llm(None, quantization="int8", kv_cache_dtype="float32", **args)
    head = llm.engine.runner.model.lm_head
    assert (head.batch_kernel, head.decode_kernel) == {
        "fp32": ("fp32", "fp32"), "amx": ("amx", "vnni"), "bf16": ("bf16", "vnni"),
        "vnni": ("int16", "vnni")}[kernels]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    answers = token_ids(llm.chat(chats()[:num_chats], params, use_tqdm=False))
    llm.engine.check_integrity()
    return answers


# Each kernel against the fp32 engine, 24 greedy tokens a chat: (kernel, its CPU check, chats,
# at least this many answers the same, every answer's first tokens the same). amx: prompts on
# AMX tiles at fp32's precision, decode on VNNI: all the same. bf16: 12 chats, so prompts and
# decode (12 rows) run in bf16, whose rounding can flip a near-tie, after which an answer goes
# its own way (measured: 9 of 12 the same, the rest for their first 2, 4 and 5 tokens). vnni:
# prompts on the int16 tile, decode of 6 rows and fewer with x in two int8 digits, near fp32.
INT8_KERNEL_ANSWERS = [
    ("amx", require_amx, 6, 6, 24),
    ("bf16", require_bf16, 12, 8, 2),
    ("vnni", require_vnni, 6, 5, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("kernel,require,num_chats,least_same,prefix", INT8_KERNEL_ANSWERS,
                         ids=[row[0] for row in INT8_KERNEL_ANSWERS])
def test_int8_kernel_serves_nearly_the_same_answers(make_llm, kernel, require, num_chats,
                                                    least_same, prefix) -> None:
    """--cpu-kernels KERNEL through the engine: greedy answers as the fp32 engine's, but for
    the near-ties its rounding may flip."""
    require()
    answers = {k: _int8_answers(make_llm, k, num_chats) for k in ("fp32", kernel)}
    pairs = list(zip(answers["fp32"], answers[kernel]))
    assert sum(a == b for a, b in pairs) >= least_same
    assert all(a[0][:prefix] == b[0][:prefix] for a, b in pairs)


@pytest.mark.slow
def test_kv_cache_dtype_is_checked(make_llm) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype 'int3'"):
        make_llm(None, kv_cache_dtype="int3")
    # int8 rows hold groups of 32: a head size that is not a multiple is refused at start-up
    assert row_width(64, torch.int8) == 80 and row_width(80, torch.float16) == 80
    with pytest.raises(ConfigError, match="head_dim divisible by 32, not 80"):
        row_width(80, torch.int8)


@pytest.mark.slow
def test_unset_step_budget_is_512_tokens_on_the_cpu(make_llm) -> None:
    llm = make_llm(None, max_num_batched_tokens=None, kv_cache_memory=64 * 2**20)
    assert llm.engine.scheduler.max_num_batched_tokens == 512
    # a KV size asked for may all hold prefix history: no resident bound
    assert llm.engine.scheduler.kv_cache_manager.block_pool.resident_blocks is None
    out = llm.generate(["Hello " * 600], SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False)[0]  # a prompt over the budget: prefilled in chunks
    assert len(out.prompt_token_ids) > 512 and len(out.outputs[0].token_ids) == 2


def _resident_pages(t: torch.Tensor) -> list[bool]:
    """mincore(2) over the pages under `t` (its first page aligned down): in memory or not."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0
    return [bool(v & 1) for v in vec]


@pytest.mark.slow
def test_idle_engine_faults_in_the_next_blocks_pages(make_llm) -> None:
    """The KV cache's pages are committed when first written; an idle engine commits those of
    the blocks it hands out next (prefault_kv_cache, `prefault_ahead` of them) without changing
    a byte, and the answers stay the same. (2 GiB: each layer's cache is then big enough for
    calloc to map it fresh, untouched; smaller ones may come zeroed from the heap, in memory.)"""
    llm = make_llm(None, kv_cache_memory=2**31, quantization="int8", kv_cache_dtype="int8")
    engine = llm.engine
    caches = engine.runner.kv_caches
    queue = engine.scheduler.kv_cache_manager.block_pool.free_block_queue
    assert [b.block_id for b in queue.peek(3)] == [1, 2, 3]  # a fresh pool: blocks in order
    far = engine.num_blocks // 2  # away from the pages K shares with V
    # Never written, so not committed, unless the allocator handed a layer memory it had used
    # before (in a process that ran other engines): such layers cannot show what prefaulting did.
    checked = [(layer, half) for layer in (0, 5, 29) for half in (0, 1)
               if not any(_resident_pages(caches[layer][half, far]))]
    if not checked:
        pytest.skip("every checked layer's far block was resident before prefaulting")
    done = engine.prefault_kv_cache(4)
    if done == 0 and not engine.prefaulter.ok:
        pytest.skip("no MADV_POPULATE_WRITE on this kernel (Linux 5.14+)")
    while (n := engine.prefault_kv_cache(4)) > 0:
        assert n <= 4
        done += n
    assert done == engine.prefault_ahead == 64  # at most 64 (2 x 2048 tokens / 16 is more)
    for layer in (0, 29):
        for half in (0, 1):
            assert all(_resident_pages(caches[layer][half, 1 : 1 + done]))
    for layer, half in checked:  # the far block was left alone
        assert not any(_resident_pages(caches[layer][half, far])), (layer, half)
    assert all(int(c[:, : 1 + done].abs().sum()) == 0 for c in caches)  # nothing written
    params = SamplingParams(temperature=0.0, max_tokens=16)
    before = token_ids(llm.chat(chats()[:3], params, use_tqdm=False))
    assert engine.prefault_kv_cache(1000) > 0  # the next ones, past the blocks now used
    assert token_ids(llm.chat(chats()[:3], params, use_tqdm=False)) == before  # prefix hits
    engine.check_integrity()
