"""A hybrid model (a tiny random Qwen3.5: linear-attention layers with a state per request)
through `loom serve` and the official client: concurrent requests, two running at a time
(their state slots handed on), each give what they give alone; streamed equals whole; a
predicted output drafts (its rejected tokens dropped from the states) and changes nothing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

PROMPTS = [f"Tell me about the number {i}." + " Please be brief." * i for i in range(6)]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> OpenAI:
    from tests.tiny_models import make_tiny_chat_model, smollm2_tokenizer

    hf = smollm2_tokenizer()
    folder = make_tiny_chat_model("qwen3_5", tmp_path_factory.mktemp("hybrid") / "tiny", hf,
                                  vocab_size=len(hf), max_position_embeddings=1024)
    server = start_server([str(folder), "--max-model-len", "1024", "--dtype", "float32",
                           "--max-num-seqs", "2", "--served-model-name", "tiny"])
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def _ask(client: OpenAI, prompt: str, **kwargs) -> str:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=24,
        temperature=0, **kwargs)
    return out.choices[0].message.content


def test_concurrent_requests_equal_alone(client: OpenAI) -> None:
    alone = [_ask(client, p) for p in PROMPTS]
    assert len(set(alone)) > 1  # (the prompts lead somewhere different)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _ask(client, p), PROMPTS))
    assert together == alone


def test_stream_equals_whole_and_prediction_drafts(client: OpenAI) -> None:
    whole = _ask(client, PROMPTS[3])
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=24,
        temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    words = whole.split(" ")
    edited = " ".join(words[:3] + ["zebra"] + words[4:])  # drafts kept, then some rejected
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=24,
        temperature=0, prediction={"type": "content", "content": edited})
    assert out.choices[0].message.content == whole
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
