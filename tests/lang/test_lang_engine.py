"""loom.lang on the default model (packaged SmolLM2) in this process: programs give the same
greedy text as their prompts sent one by one, `select` is the argmax of independently computed
logprobs, and forks share their prefix blocks (read from the engine's prefix-cache counter)."""

from __future__ import annotations

import json
import re

import pytest

from loom import LLM, SamplingParams
from loom.lang import EngineBackend, assistant, function, gen, select, system, user

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # batch-invariant kernels, as every test comparing batched requests with lone ones: the
    # default int8 kernels compute a prompt's rows past 8 with other bits (docs/cpu_kernels.md),
    # and a batch's make-up depends on when each fork's request arrives (a near-tie flipped once
    # in a CI run on the AVX2 VM: "magical fox." alone, "magical fox" batched)
    return LLM(max_model_len=1024, kv_cache_memory=128 * 2**20, batch_invariant=True)


def one_by_one(llm: LLM, prompt: str | list[int], **kwargs) -> str:
    params = GREEDY.clone(**kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


@function
def two_turns(s, question):
    s += system("You answer in one sentence.")
    s += user(question)
    s += assistant(gen("first", max_tokens=12))
    s += user("Say it differently.")
    s += assistant(gen("second", max_tokens=12))


def test_chat_program_matches_prompts_sent_one_by_one(llm):
    with EngineBackend(llm) as backend:
        state = two_turns.run("Why is the sky blue?", backend=backend)
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "Why is the sky blue?"}]
    first = one_by_one(llm, tok.apply_chat_template(messages))
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": "Say it differently."}]
    second = one_by_one(llm, tok.apply_chat_template(messages))
    assert (state["first"], state["second"]) == (first, second)
    assert state.messages() == [*messages, {"role": "assistant", "content": second}]
    assert state.text() == tok.apply_chat_template(state.messages(), add_generation_prompt=False)
    meta = state.meta("second")
    assert meta.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages)))
    assert meta.completion_tokens == len(meta.logprobs) == 12
    assert meta.finish_reason == "length" and all(lp <= 0 for lp in meta.logprobs)


def test_run_batch_and_forks_match_one_by_one(llm):
    @function
    def story(s, animal):
        s += f"A short story about a {animal}. Once upon a time"
        s += gen("opening", max_tokens=10)
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nEnding {i + 1}:" + gen("ending", max_tokens=8)
        forks.join()
        s += "\nEndings:" + "|".join(f["ending"] for f in forks)

    animals = ["cat", "whale", "fox"]
    with EngineBackend(llm) as backend:
        states = story.run_batch([{"animal": a} for a in animals], backend=backend)
    for animal, state in zip(animals, states):
        prompt = f"A short story about a {animal}. Once upon a time"
        opening = one_by_one(llm, prompt, max_tokens=10)
        endings = [one_by_one(llm, prompt + opening + f"\nEnding {i + 1}:", max_tokens=8)
                   for i in range(2)]
        assert state["opening"] == opening
        assert state.text() == prompt + opening + "\nEndings:" + "|".join(endings)


def test_select_is_the_argmax_of_independent_logprobs(llm):
    prefix = "Q: What color is a ripe banana?\nA: It is"
    choices = [" yellow", " purple", " blue-green", "yellow"]  # the last merges differently
    with EngineBackend(llm) as backend:
        state = function(lambda s: s.__iadd__(prefix + select("c", choices=choices))).run(
            backend=backend)
    tok = llm.get_tokenizer()
    prefix_ids = tok.encode(prefix)
    sums = []
    for c in choices:  # each scored alone, from where all tokenizations leave the prefix
        ids = tok.encode(prefix + c)
        out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        start = min(_common(prefix_ids, tok.encode(prefix + d)) for d in choices)
        sums.append(sum(lp.logprobs[0] for lp in out[0].prompt_logprobs[start:]))
    meta = state.meta("c")
    assert state["c"] == choices[max(range(len(choices)), key=sums.__getitem__)]
    assert meta.choice_logprobs == pytest.approx(sums, abs=1e-3)
    assert [len(t) for t in meta.choice_token_logprobs] == [
        len(tok.encode(prefix + c)) - min(_common(prefix_ids, tok.encode(prefix + d))
                                          for d in choices) for c in choices]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_forks_share_prefix_blocks(llm):
    context = "The river of Antwerp flows past ninety-one silver mills and a harbor. " * 6
    branches = 4

    @function
    def tree(s):
        s += context
        forks = s.fork(branches)
        for i, f in enumerate(forks):
            f += f"Thought {i}:" + gen("t", max_tokens=4)
        forks.join()

    tok = llm.get_tokenizer()
    ids = [tok.encode(context + f"Thought {i}:") for i in range(branches)]
    shared = min(_common(ids[0], other) for other in ids[1:])
    block = llm.engine.scheduler.kv_cache_manager.block_size
    with EngineBackend(llm) as backend:
        queries0, hits0 = backend.prefix_cache_stats()
        state = tree.run(backend=backend)
        queries, hits = backend.prefix_cache_stats()
    assert state.text() == context  # the root holds the context only
    # the first branch computes the context; every other branch finds its full blocks
    assert hits - hits0 == (branches - 1) * (shared // block) * block
    assert queries - queries0 == sum(len(i) for i in ids)


def test_constrained_gens_and_streaming(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}

    @function
    def extract(s):
        s += user("Alice is 31 years old. Give her name and age as JSON, then a year.")
        s += assistant(gen("person", json_schema=schema, max_tokens=40) + "\nYear: "
                       + gen("year", regex=r"(19|20)[0-9]{2}", max_tokens=6)
                       + "\nMood: " + gen("mood", choices=["happy", "sad"], max_tokens=4))

    with EngineBackend(llm) as backend:
        state = extract.run(backend=backend, stream=True)
        streamed = "".join(state.text_iter())
        year_pieces = list(state.text_iter("year"))
    person = json.loads(state["person"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"(19|20)[0-9]{2}", state["year"])
    assert state["mood"] in ("happy", "sad")
    assert streamed == state.text()
    assert "".join(year_pieces) == state["year"]


def test_select_choices_share_their_prefix(llm):
    prefix = "Copper lanterns hung over the quiet quarry road near the old mill. " * 5 + "Verdict:"
    choices = [" yes", " no", " maybe"]
    tok = llm.get_tokenizer()
    start = min(_common(tok.encode(prefix), tok.encode(prefix + c)) for c in choices)
    block = llm.engine.scheduler.kv_cache_manager.block_size
    with EngineBackend(llm) as backend:
        _, hits0 = backend.prefix_cache_stats()
        state = function(lambda s: s.__iadd__(prefix + select("v", choices=choices))).run(
            backend=backend)
        _, hits = backend.prefix_cache_stats()
    # one choice computes the prefix; the others find its blocks up to the scored position
    assert hits - hits0 == (len(choices) - 1) * ((start - 1) // block) * block > 0
    scores = []
    for c in choices:  # every prompt position computed, one request at a time
        out = llm.generate(tok.encode(prefix + c), SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        scores.append(sum(lp.logprobs[0] for lp in out.prompt_logprobs[start:]))
    # the prefix's keys and values now come from the (quantized) cache: close, not bit-equal
    assert state.meta("v").choice_logprobs == pytest.approx(scores, abs=2e-2)
    assert state["v"] == choices[max(range(len(choices)), key=scores.__getitem__)]
