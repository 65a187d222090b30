"""`loom serve --speculative-config`: completions through the official client, the speculation
counters on /metrics, and a bad configuration refused at start-up."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.server.conftest import _stop_all_servers, start_server  # noqa: F401
from tests.engine_fixtures import make_llm  # noqa: F401
from tests.server.utils import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

# a fixed draft length: these tests are about what the server returns for drafts (several tokens
# a chunk, the counters), so the adaptive length, which follows measured step times and may
# draft nothing on a loaded machine, has its own tests (test_spec_unit.py, test_spec_engine.py)
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "adaptive": False})
PROMPT = ("Repeat this sentence three times: the quick brown fox jumps over the lazy dog.\n"
          "the quick brown fox jumps over the lazy dog.\n")


@pytest.fixture(scope="module")
def spec_server() -> ServerProcess:
    return start_server([*ENGINE_ARGS, "--speculative-config", SPEC])


def test_completions_and_metrics(spec_server: ServerProcess) -> None:
    client = OpenAI(base_url=f"{spec_server.url}/v1", api_key="x")
    model = client.models.list().data[0].id
    before = spec_server.wait_idle()
    kw = dict(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    whole = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert whole.choices[0].text == streamed and whole.usage.completion_tokens == 40
    # logprobs: one entry per token, several tokens a streamed chunk after a verify step
    lp = client.completions.create(**kw, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 40 and lp.choices[0].text == streamed
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        **kw, logprobs=2, stream=True) if c.choices and c.choices[0].logprobs]
    assert sum(len(c.tokens) for c in chunks) == 40 and max(len(c.tokens) for c in chunks) > 1
    assert [v for c in chunks for v in c.token_logprobs] == pytest.approx(
        lp.choices[0].logprobs.token_logprobs, abs=1e-5)
    after = spec_server.wait_idle()
    drafts = after["loom:spec_decode_num_draft_tokens_total"]
    accepted = after["loom:spec_decode_num_accepted_tokens_total"]
    assert drafts > before.get("loom:spec_decode_num_draft_tokens_total", 0)
    assert 0 < accepted <= drafts
    assert after["loom:spec_decode_acceptance_rate"] == pytest.approx(accepted / drafts)


def test_bad_config_refused_at_start() -> None:
    server = ServerProcess([*ENGINE_ARGS, "--speculative-config", '{"method": "medusa"}'])
    with pytest.raises(RuntimeError, match="speculative_config method 'medusa'"):
        server.start()


def test_beam_search_completions(spec_server: ServerProcess, make_llm) -> None:
    """use_beam_search on /v1/completions gives LLM.beam_search's best beams (both run the
    same batch-invariant kernels); unsupported combinations are 400s naming the field."""
    from loom.engine.beam_search import BeamSearchParams

    client = OpenAI(base_url=f"{spec_server.url}/v1", api_key="x")
    model = client.models.list().data[0].id
    prompts = ["The capital of France is", "def fibonacci(n):"]
    extra = {"use_beam_search": True, "beam_width": 3, "length_penalty": 0.8}
    out = client.completions.create(model=model, prompt=prompts, max_tokens=8, n=2,
                                    temperature=0, extra_body=extra)
    ref = make_llm(None).beam_search(prompts, BeamSearchParams(3, 8, length_penalty=0.8))
    expected = [seq.text for r in ref for seq in r.sequences[:2]]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    assert out.usage.completion_tokens == sum(
        len(seq.token_ids) for r in ref for seq in r.sequences[:2])
    spec_server.wait_idle()
    import httpx

    for body, field in (({"stream": True}, "stream"), ({"logprobs": 1}, "logprobs"),
                        ({"temperature": 0.7}, "temperature"), ({"n": 4}, "n")):
        r = httpx.post(f"{spec_server.url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "hi", "max_tokens": 4, **extra, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(f"{spec_server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": "hi", "max_tokens": 4, "beam_width": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "beam_width", r.text
