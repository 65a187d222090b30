"""Isolation inside the engine step (issue 25): a request whose own inputs break preparing,
sampling or its grammar fails alone, with its own error and its blocks freed, while the other
requests of the same steps give exactly the tokens they give alone. Real engine, real model;
the faults are real bad values put where validation would have stopped them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from loom import LLM, SamplingParams
from loom.engine.async_engine import AsyncEngine, RequestFailedError
from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import RequestOutput

pytestmark = pytest.mark.slow

PROMPTS = ["Count: one, two,", "The capital of France is"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLM(None, max_model_len=1024, kv_cache_memory=64 * 2**20, batch_invariant=True).engine


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]],
        before: Callable[[], None] | None = None,
        after_first: Callable[[], None] | None = None) -> dict[str, RequestOutput]:
    """Add every request, then `before()`, step until all finish (`after_first()` after the
    first step); the KV cache is whole at the end."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    if before is not None:
        before()
    finals: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        if step == 1 and after_first is not None:
            after_first()
    engine.check_integrity()
    return finals


def _bystanders() -> dict[str, tuple[str, SamplingParams]]:
    return {"greedy": (PROMPTS[0], GREEDY), "seeded": (PROMPTS[1], SEEDED)}


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in run(engine, _bystanders()).items()}


def _check(finals: dict[str, RequestOutput], alone: dict[str, list[int]], bad: str) -> str:
    for rid, ids in alone.items():
        assert finals[rid].error is None
        assert finals[rid].outputs[0].token_ids == ids, rid
    assert finals[bad].error is not None
    assert finals[bad].outputs[0].finish_reason == "error"
    return finals[bad].error


def test_bad_sampling_input_fails_alone(engine: LLMEngine, alone: dict[str, list[int]]) -> None:
    """A logit_bias token id past the vocabulary (set after validation) breaks the sampler's
    metadata for its row only."""
    params = SamplingParams(temperature=0.7, max_tokens=10, logit_bias={5: 1.0})
    finals = run(engine, {**_bystanders(), "bad": ("Hello", params)},
                 before=lambda: setattr(params, "logit_bias", {10**30: 1.0}))
    assert "preparing the request" in _check(finals, alone, "bad")


def test_bad_value_mid_generation_fails_alone(engine: LLMEngine,
                                              alone: dict[str, list[int]]) -> None:
    """A penalty that turns into a string after the request started breaks batch sampling;
    the batch is sampled again row by row and only the culprit fails."""
    params = SamplingParams(temperature=0.7, max_tokens=10, presence_penalty=0.5)
    finals = run(engine, {**_bystanders(), "bad": ("Hello", params)},
                 after_first=lambda: setattr(params, "presence_penalty", "oops"))
    assert "sampling" in _check(finals, alone, "bad")


def test_grammar_failing_mid_generation_fails_alone(engine: LLMEngine,
                                                    alone: dict[str, list[int]]) -> None:
    """A grammar matcher in its error state (here: fed a token it forbids) fails its request
    with the grammar engine's reason, never a silent "abort"."""
    params = SamplingParams(temperature=0, max_tokens=10,
                            structured_outputs={"regex": "[ab]{1,30}"})

    def break_grammar() -> None:
        request = engine.scheduler.requests["bad"]
        request.grammar.accept_token(engine.tokenizer.encode("zzz", False)[0])

    finals = run(engine, {**_bystanders(), "bad": ("Say ab:", params)},
                 after_first=break_grammar)
    assert _check(finals, alone, "bad").startswith("the output constraint failed")


def test_async_engine_raises_the_requests_own_error(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.7, max_tokens=4, presence_penalty=0.5)

    async def go() -> tuple[BaseException | None, list[int]]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            async def collect(rid: str, prompt: str, p: SamplingParams) -> list[int]:
                ids: list[int] = []
                async for out in async_engine.generate(prompt, p, rid):
                    ids = out.outputs[0].token_ids
                return ids

            good_task = asyncio.ensure_future(collect("a-good", PROMPTS[0], GREEDY))
            stream = await async_engine.add_request("a-bad", "Hello", params)
            params.presence_penalty = "oops"  # type: ignore[assignment] - breaks its sampling
            try:
                async for _ in stream:
                    pass
                bad: BaseException | None = None
            except RequestFailedError as e:
                bad = e
            good = await good_task
            return bad, good
        finally:
            await async_engine.shutdown()

    error, good = asyncio.run(go())
    assert isinstance(error, RequestFailedError) and not error.invalid
    assert len(good) == GREEDY.max_tokens
