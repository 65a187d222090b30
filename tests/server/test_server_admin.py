"""A second server with an API key (from LOOM_API_KEY), two running sequences and a waiting
queue of one, scheduled by priority, splitting thinking blocks off (--reasoning-parser
deepseek_r1): 401s, 429, a better-ranked request preempting a running one, reasoning_content,
and, last because it ends the server, graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import start_server
from tests.server.utils import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow  # real `loom serve` subprocesses

KEY = "sk-loom-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE_S = 12


@pytest.fixture(scope="module")
def admin_server() -> ServerProcess:
    return start_server(
        # Room for a request that outlasts the grace period at any speed (_long).
        [*ENGINE_ARGS, "--max-model-len", "4096", "--max-num-seqs", "2",
         "--max-waiting-requests", "1", "--scheduling-policy", "priority",
         "--reasoning-parser", "deepseek_r1",
         "--timeout-graceful-shutdown", str(GRACE_S), "--served-model-name", "loom-test"],
        env={"LOOM_API_KEY": KEY},
    )


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": KEY}, 401),
     (AUTH, 200)],
    ids=["missing", "wrong", "not-bearer", "right"],
)
def test_api_key_on_v1(admin_server: ServerProcess, headers: dict, status: int) -> None:
    r = httpx.get(f"{admin_server.url}/v1/models", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["type"] == "authentication_error"
    else:
        assert r.json()["data"][0]["id"] == "loom-test"


def test_probes_stay_open_and_other_routes_need_the_key(admin_server: ServerProcess) -> None:
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{admin_server.url}{path}").status_code == 200
    r = httpx.post(f"{admin_server.url}/tokenize", json={"prompt": "x"})
    assert r.status_code == 401
    assert httpx.get(f"{admin_server.url}/no/such/route").status_code == 401


def test_openai_client_with_and_without_key(admin_server: ServerProcess) -> None:
    good = openai.OpenAI(base_url=f"{admin_server.url}/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(model="loom-test", prompt="Hi", max_tokens=2)
    assert out.model == "loom-test" and out.usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=f"{admin_server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="loom-test", prompt="Hi", max_tokens=2)


def _long(stream: bool) -> dict[str, Any]:
    return {"prompt": "Write an endless story.", "max_tokens": 4000, "ignore_eos": True,
            "stream": stream}


def _count(url: str, text: str) -> int:
    return httpx.post(f"{url}/tokenize", headers=AUTH, json={"prompt": text}).json()["count"]


def _wait_metric(server: ServerProcess, name: str, at_least: float, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics()[name] < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        time.sleep(0.1)


def test_429_when_the_waiting_queue_is_full(admin_server: ServerProcess) -> None:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=admin_server.url, headers=AUTH,
                                     timeout=600) as http:
            async with http.stream("POST", "/v1/completions", json=_long(True)) as first, \
                    http.stream("POST", "/v1/completions", json=_long(True)) as second:
                # Keep the line iterators referenced: a collected one closes its connection.
                readers = [first.aiter_lines(), second.aiter_lines()]
                for lines in readers:
                    while not (await lines.__anext__()).startswith("data: {"):
                        pass  # both running slots are taken
                waiting = asyncio.create_task(http.post("/v1/completions", json=_long(False)))
                deadline = time.monotonic() + 120
                while admin_server.metrics()["loom:num_requests_waiting"] < 1:
                    assert time.monotonic() < deadline, "the third request never waited"
                    await asyncio.sleep(0.1)
                rejected = await http.post("/v1/completions",
                                           json={"prompt": "hi", "max_tokens": 2})
                waiting.cancel()
            return rejected

    rejected = asyncio.run(run())
    assert rejected.status_code == 429
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    admin_server.wait_idle()  # both dropped requests were aborted


def test_a_better_priority_preempts_a_running_request(admin_server: ServerProcess) -> None:
    """Both running slots hold endless streams of priority 5; a request of priority 0 (the
    `openai` client's extra_body) preempts one of them and is answered while both still run;
    the preempted stream then goes on (recomputed), and an equal rank waits its turn."""
    client = openai.OpenAI(base_url=f"{admin_server.url}/v1", api_key=KEY, max_retries=0,
                           timeout=300)
    before = admin_server.metrics().get("loom:num_preemptions_total", 0)

    async def run() -> tuple[str, float, list[int]]:
        async with httpx.AsyncClient(base_url=admin_server.url, headers=AUTH,
                                     timeout=600) as http:
            body = {**_long(True), "priority": 5}
            async with http.stream("POST", "/v1/completions", json=body) as first, \
                    http.stream("POST", "/v1/completions", json=body) as second:
                readers = [first.aiter_lines(), second.aiter_lines()]
                for lines in readers:
                    while not (await lines.__anext__()).startswith("data: {"):
                        pass  # both running slots are taken
                urgent = await asyncio.to_thread(
                    client.completions.create, model="loom-test", prompt="Say yes.",
                    max_tokens=3, temperature=0, extra_body={"priority": 0})
                m = admin_server.metrics()  # neither stream has ended
                alive = m["loom:num_requests_running"] + m["loom:num_requests_waiting"]
                more = []  # and both go on
                for lines in readers:
                    line = await lines.__anext__()
                    while not line.startswith("data: {"):
                        line = await lines.__anext__()
                    more.append(len(line))
            return urgent.choices[0].finish_reason, alive, more

    finish, alive, more = asyncio.run(run())
    assert finish == "length" and alive == 2 and all(more)
    assert admin_server.metrics()["loom:num_preemptions_total"] >= before + 1
    admin_server.wait_idle()  # both dropped streams were aborted


def test_thinking_block_is_reasoning_content(admin_server: ServerProcess) -> None:
    """A reply inside the thinking block its prompt opened (an assistant prefill `<think>`) is
    all reasoning_content while the block is open, the same streamed (delta.reasoning_content)
    as whole; constrained, it may think first (free text up to `</think>`, here forced by a
    bias) and its answer alone matches the constraint; a reply without a block keeps all its
    text as content."""
    client = openai.OpenAI(base_url=f"{admin_server.url}/v1", api_key=KEY, max_retries=0)
    opened = [{"role": "user", "content": "Is the sky blue?"},
              {"role": "assistant", "content": "<think>"}]
    kwargs: dict[str, Any] = dict(
        model="loom-test", messages=opened, max_tokens=24, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    whole = client.chat.completions.create(**kwargs).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert whole.finish_reason == "length" and reasoning and not whole.message.content
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": reasoning, "content": ""}
    # the block closes at once (the closing tag's tokens biased), then the constrained answer
    close = httpx.post(f"{admin_server.url}/tokenize", headers=AUTH,
                       json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    pattern = "[A-Z][a-z ]{3,20}\\."
    constrained = client.chat.completions.create(**{**kwargs, "max_tokens": 48, "logprobs": True,
        "logit_bias": {str(t): 100 for t in close}, "extra_body": {
            **kwargs["extra_body"], "structured_outputs": {"regex": pattern}}}).choices[0]
    tokens = [t.token for t in constrained.logprobs.content]
    assert "".join(tokens).startswith("</think>")  # the grammar let it close the block first
    assert re.fullmatch(pattern, constrained.message.content)
    assert constrained.finish_reason == "stop"
    plain = client.chat.completions.create(
        model="loom-test", messages=opened[:1], max_tokens=24, temperature=0).choices[0].message
    assert plain.model_extra["reasoning_content"] is None and plain.content


def test_graceful_shutdown(admin_server: ServerProcess) -> None:
    """SIGTERM: the short request finishes, the endless one ends with an error after the grace
    period, new connections are refused, and the process exits 0."""
    url = admin_server.url
    start_tokens = admin_server.metrics()["loom:prompt_tokens_total"]
    results: dict[str, Any] = {}

    def short() -> None:
        results["short"] = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=600,
                                      json={"prompt": "Hello", "max_tokens": 20,
                                            "ignore_eos": True})

    def endless() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=600,
                          json=_long(True)) as r:
            results["endless"] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=endless), threading.Thread(target=short)]
    threads[0].start()
    _wait_metric(admin_server, "loom:num_requests_running", 1)
    threads[1].start()
    both = start_tokens + _count(url, _long(True)["prompt"]) + _count(url, "Hello")
    _wait_metric(admin_server, "loom:prompt_tokens_total", both)  # both are in flight
    admin_server.signal(signal.SIGTERM)

    refused_by = time.monotonic() + 5
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            # The listening socket is closed; a connection that reached the accept backlog
            # just before that is reset rather than refused.
            break
        assert time.monotonic() < refused_by, "still accepting connections after SIGTERM"
        time.sleep(0.1)
    for t in threads:
        t.join(GRACE_S + 120)
    assert admin_server.wait(GRACE_S + 120) == 0

    short_response = results["short"]
    assert short_response.status_code == 200
    assert short_response.json()["usage"]["completion_tokens"] == 20
    events = results["endless"]
    assert events[-1] == "data: [DONE]"
    assert '"type":"unavailable_error"' in events[-2]
    assert len(events) > 3  # it did stream before the grace period ran out
