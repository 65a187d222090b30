"""`loom serve --speculative-config`: completions through the official client, the speculation
counters on /metrics, and a bad configuration refused at start-up."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.server.conftest import _stop_all_servers, start_server  # noqa: F401
from tests.server.utils import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
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
    # logprobs: this request does not speculate, and still gets one entry per token
    lp = client.completions.create(**kw, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 40 and lp.choices[0].text == streamed
    after = spec_server.wait_idle()
    drafts = after["loom:spec_decode_num_draft_tokens_total"]
    accepted = after["loom:spec_decode_num_accepted_tokens_total"]
    assert drafts > before.get("loom:spec_decode_num_draft_tokens_total", 0)
    assert 0 < accepted <= drafts
    assert after["loom:spec_decode_acceptance_rate"] == pytest.approx(accepted / drafts)


def test_bad_config_refused_at_start() -> None:
    server = ServerProcess([*ENGINE_ARGS, "--speculative-config", '{"method": "medusa"}'])
    with pytest.raises(RuntimeError, match="only 'ngram' is supported"):
        server.start()
