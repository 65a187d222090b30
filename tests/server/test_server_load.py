"""Many users at once: 32 concurrent greedy streams equal the offline `LLM.generate` result;
a client that drops its request frees its KV blocks while others go on; /metrics after traffic."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from openai import AsyncOpenAI

from loom import LLM, SamplingParams
from tests.server.utils import ServerProcess

pytestmark = pytest.mark.slow  # real `loom serve` subprocesses

NUM_STREAMS = 32
MAX_TOKENS = 12
PROMPTS = [f"Question {i}: what comes after the number {i * 7}? Answer:" for i in
           range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def offline_texts() -> list[str]:
    """Reference outputs from the offline engine in this process (same model, greedy)."""
    llm = LLM(None, max_model_len=1024, kv_cache_memory=256 * 2**20, batch_invariant=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    del llm
    return texts


async def _stream_one(client: AsyncOpenAI, model: str, prompt: str) -> tuple[str, int]:
    text, chunks = "", 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True)
    async for chunk in stream:
        chunks += 1
        text += "".join(c.text for c in chunk.choices)
    return text, chunks


def test_32_concurrent_streams_equal_offline(
    async_client: AsyncOpenAI, model_name: str, offline_texts: list[str]
) -> None:
    async def run() -> list[tuple[str, int]]:
        return await asyncio.gather(*(_stream_one(async_client, model_name, p) for p in PROMPTS))

    results = asyncio.run(run())
    assert [text for text, _ in results] == offline_texts
    assert sum(chunks for _, chunks in results) > 2 * NUM_STREAMS  # really streamed


def _long_body(stream: bool) -> dict:
    return {"prompt": "Tell me a very long story.", "max_tokens": 900, "stream": stream,
            "ignore_eos": True, "temperature": 0}


def test_dropped_stream_frees_its_blocks(server: ServerProcess) -> None:
    before = server.wait_idle()
    result: dict[str, httpx.Response] = {}

    def other_request() -> None:
        body = {"prompt": "Count: one, two,", "max_tokens": 24, "ignore_eos": True,
                "temperature": 0}
        result["r"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)

    with httpx.Client(timeout=600) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=_long_body(True)) as r:
            lines = r.iter_lines()
            events = [next(lines) for _ in range(6)]  # a few tokens in: it holds KV blocks
            other = threading.Thread(target=other_request)
            other.start()
            assert server.metrics()["loom:kv_cache_usage_perc"] > 0
        # Leaving the `with` closed the connection mid-stream.
    assert any(e.startswith("data: {") for e in events)
    other.join(600)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 24  # the other one went on
    after = server.wait_idle()
    generated = after["loom:generation_tokens_total"] - before["loom:generation_tokens_total"]
    assert generated < 900  # the dropped request stopped long before its 900 tokens


def test_dropped_non_streaming_request_is_aborted(server: ServerProcess) -> None:
    before = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=_long_body(False), timeout=3)
    after = server.wait_idle()
    assert after["loom:generation_tokens_total"] - before["loom:generation_tokens_total"] < 900


def test_metrics_after_traffic(server: ServerProcess) -> None:
    before = server.wait_idle()
    prompt = "A shared prefix long enough to fill a few KV blocks of sixteen tokens each. " * 3
    usages = []
    for _ in range(2):  # the second request hits the prefix cache
        r = httpx.post(f"{server.url}/v1/completions",
                       json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True,
                             "temperature": 0}, timeout=600)
        usages.append(r.json()["usage"])
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("loom:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("loom:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("loom:prefix_cache_queries_total") >= 2 * usages[0]["prompt_tokens"]
    assert delta("loom:prefix_cache_hits_total") >= 32
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"loom:{name}_count") == 2
        assert after[f"loom:{name}_sum"] > 0
    # a gap a step after the first token: at least one a request, at most one a token after
    # its first (fewer where steps ran ahead: --num-scheduler-steps' CPU default runs up to 4
    # tokens a step only while decode steps are short, so how many is the machine's speed)
    tokens = sum(u["completion_tokens"] for u in usages)
    assert 2 <= delta("loom:inter_token_latency_seconds_count") <= tokens - 2
    assert "loom:num_preemptions_total" in after
    text = httpx.get(f"{server.url}/metrics").text
    assert "# TYPE loom:time_to_first_token_seconds histogram" in text
    assert 'loom:kv_cache_usage_perc{model_name="smollm2"} 0.0' in text

