"""loom.lang on a real `loom serve` subprocess: the same program gives the same greedy results
on the server backend as on the in-process engine; select is exact there (echo + logprobs) and
falls back, with a warning, when told the server cannot score."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loom import LLM
from loom.lang import (
    EngineBackend, LangError, LangFallbackWarning, OpenAIBackend, assistant, function, gen,
    select, system, user,
)
from tests.server.utils import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(ENGINE_ARGS)
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def remote(server: ServerProcess) -> Iterator[OpenAIBackend]:
    with OpenAIBackend(f"{server.url}/v1", tokenizer="smollm2") as backend:
        yield backend


@function
def judge(s, claim):
    s += system("You check facts.")
    s += user(f"Claim: {claim}\nIs it true?")
    s += assistant("Verdict:" + select("verdict", choices=[" true", " false", " unsure"])
                   + "\nReason:" + gen("reason", max_tokens=10, stop="\n"))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += user(f"Give hint {i + 1}.") + assistant(gen("hint", max_tokens=8))
    forks.join()
    s += user("Hints: " + " / ".join(f["hint"] for f in forks) + "\nSummary?")
    s += assistant(gen("summary", max_tokens=8))


def _results(state) -> dict[str, object]:
    return {"vars": state.variables(), "text": state.text(),
            "scores": state.meta("verdict").choice_logprobs}


def test_both_backends_give_the_same_greedy_results(remote):
    claim = "Water boils at 100 C at sea level."
    r = judge.run(claim, backend=remote)
    # The server's batch-invariant kernels (ENGINE_ARGS): the same bits in any batch.
    with EngineBackend(LLM(max_model_len=1024, kv_cache_memory=128 * 2**20,
                           batch_invariant=True)) as local:
        loc = judge.run(claim, backend=local)
    got, want = _results(r), _results(loc)
    assert got["vars"] == want["vars"] and got["text"] == want["text"]
    assert got["scores"] == pytest.approx(want["scores"], abs=1e-3)
    assert r.meta("verdict").exact
    meta = r.meta("summary")
    assert meta.completion_tokens == len(meta.logprobs) > 0
    assert meta.prompt_tokens == loc.meta("summary").prompt_tokens


def test_select_falls_back_with_a_warning(server):
    prompt, choices = "The capital of France is", [" Paris", " Rome"]
    with OpenAIBackend(f"{server.url}/v1", exact_select=False) as backend:
        @function
        def pick(s):
            s += prompt + select("city", choices=choices)

        with pytest.warns(LangFallbackWarning, match="falls back"):
            state = pick.run(backend=backend)
        # the fallback takes the choice that the greedy continuation starts with
        greedy = backend.client.post(f"{server.url}/v1/completions", json={
            "model": backend.model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
        }).json()["choices"][0]["text"]
    assert greedy.startswith(state["city"])
    meta = state.meta("city")
    assert not meta.exact
    assert meta.choice_logprobs == [0.0 if c == state["city"] else None for c in choices]


def test_server_errors_reach_the_program(remote):
    @function
    def bad(s):
        s += "x" + gen("y", regex="(")

    with pytest.raises(LangError, match="400"):
        bad.run(backend=remote)

    @function
    def chat(s):
        s += user("hi")

    with OpenAIBackend(remote.base_url) as no_template, pytest.raises(LangError, match="template"):
        chat.run(backend=no_template)
