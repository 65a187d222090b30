"""Hostile requests against the real server (issue 25): each finding of the hardening pass as a
request in, a status and an OpenAI error envelope out; a greedy stream beside each bad request
finishes with the tokens it gives alone; /health keeps answering while the largest accepted body
is tokenized; the waiting queue answers 429 with Retry-After; memory comes back after a storm."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import psutil
import pytest

from tests.server.conftest import start_server
from tests.server.utils import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
DEEP = "[" * 10_000 + "]" * 10_000  # JSON text 10,000 levels deep
MAX_WAITING = 4


@pytest.fixture(scope="module")
def srv() -> ServerProcess:
    return start_server([*ENGINE_ARGS, "--max-num-seqs", "4",
                         "--max-waiting-requests", str(MAX_WAITING)])


def post(server: ServerProcess, path: str, body: Any, timeout: float = 120) -> httpx.Response:
    """POST `body` as JSON text written by json.dumps (ASCII escapes: lone surrogates pass)."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=timeout,
                      headers={"content-type": "application/json"})


def assert_error(r: httpx.Response, status: int, param: str | None,
                 contains: str = "") -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert contains in error["message"], error
    return error


# (name, path, body, status, param, text in the message): the six findings' requests
FINDINGS: list[tuple[str, str, Any, int, str | None, str]] = [
    # 1. integers past 64 bits
    ("seed 2**64", CMPL, {"prompt": "Hello there", "max_tokens": 4, "seed": 2**64}, 400,
     "seed", "64-bit"),
    ("chat seed below int64", CHAT, {"messages": USER, "max_tokens": 4,
                                     "seed": -(2**63) - 1}, 400, "seed", "64-bit"),
    # 2. lone surrogates
    ("prompt lone surrogate", CMPL, {"prompt": "x\ud800y", "max_tokens": 2}, 400, "prompt",
     "surrogate"),
    ("chat lone surrogate", CHAT, {"messages": [{"role": "user", "content": "x\udfffy"}]},
     400, "messages[0].content", "surrogate"),
    ("tokenize lone surrogate", "/tokenize", {"prompt": "x\ud800"}, 400, "prompt",
     "surrogate"),
    # 3. deep nesting inside string fields, and in the body itself
    ("guided_json 10k deep", CMPL, {"prompt": "hi", "guided_json": DEEP}, 400, "guided_json",
     "deeper"),
    ("structured_outputs.json 10k deep", CMPL, {"prompt": "hi", "structured_outputs": {
        "json": DEEP}}, 400, "structured_outputs", "deeper"),
    ("tool arguments 10k deep", CHAT, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, 400,
     "messages[1].tool_calls[0].function.arguments", "deeper"),
    ("body 10k deep", CMPL, '{"prompt": "hi", "guided_json": ' + '{"a": ' * 10_000 + "1"
     + "}" * 10_001, 400, None, "deeper"),
    # 4. grammars that compile but cannot run: the grammar engine's own reason
    ("regex past the lexer's limit", CMPL, {"prompt": "hi", "max_tokens": 4,
                                            "guided_regex": "((a{100}){100}){100}"}, 400,
     "guided_regex", "too many expressions"),
    ("20,000 choices", CMPL, {"prompt": "hi", "max_tokens": 4, "guided_choice": [
        f"option {i}" for i in range(20_000)]}, 400, "guided_choice", "max is 2000"),
    # 5. big bodies, refused before tokenizing
    ("10 MB prompt", CMPL, {"prompt": "word " * 2_000_000, "max_tokens": 2}, 400, "prompt",
     "characters"),
    ("4 MB chat", CHAT, {"messages": [{"role": "user", "content": "word " * 800_000}]}, 400,
     "messages", "characters"),
    ("200,000 token ids", CMPL, {"prompt": [1] * 200_000, "max_tokens": 2}, 400, "prompt",
     "max_model_len"),
    ("stop list too long", CMPL, {"prompt": "hi", "stop": ["x"] * 100}, 400, "stop", "64"),
    ("logit_bias too large", CMPL, {"prompt": "hi", "logit_bias": {
        str(i): 1 for i in range(2000)}}, 400, "logit_bias", "1024"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "contains"),
                         [pytest.param(*f[1:], id=f[0]) for f in FINDINGS])
def test_finding(srv: ServerProcess, path: str, body: Any, status: int, param: str | None,
                 contains: str) -> None:
    assert_error(post(srv, path, body), status, param, contains)


def test_top_k_past_64_bits_is_clamped_as_vllm(srv: ServerProcess) -> None:
    """top_k beyond the vocabulary keeps every token (vLLM's rule): a normal completion."""
    r = post(srv, CMPL, {"prompt": "Hello there", "max_tokens": 4, "temperature": 0.7,
                         "top_k": 10_000_000_000_000_000_000, "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_body_over_limit_is_413(srv: ServerProcess) -> None:
    r = post(srv, CMPL, b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}')
    assert_error(r, 413, None, "larger than")


BYSTANDER = {"prompt": "Count: one, two,", "max_tokens": 24, "ignore_eos": True,
             "temperature": 0, "stream": True}


def _stream_text(server: ServerProcess, started: threading.Event | None = None) -> str:
    text = ""
    with httpx.stream("POST", f"{server.url}{CMPL}", json=BYSTANDER, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            if started is not None:
                started.set()
    return text


@pytest.fixture(scope="module")
def alone(srv: ServerProcess) -> str:
    return _stream_text(srv)


@pytest.mark.parametrize(("path", "body", "status", "param", "contains"),
                         [pytest.param(*f[1:], id=f[0]) for f in FINDINGS[:11]])
def test_bystander_unaffected(srv: ServerProcess, alone: str, path: str, body: Any,
                              status: int, param: str | None, contains: str) -> None:
    """A greedy stream running while the bad request is handled gives its tokens alone."""
    started = threading.Event()
    result: dict[str, str] = {}
    thread = threading.Thread(target=lambda: result.update(text=_stream_text(srv, started)))
    thread.start()
    assert started.wait(120)
    assert_error(post(srv, path, body), status, param, contains)
    thread.join(300)
    assert result["text"] == alone


def test_queue_full_is_429_with_retry_after(srv: ServerProcess) -> None:
    metrics = srv.metrics()
    assert metrics["loom:max_waiting_requests"] == MAX_WAITING
    body = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    statuses: list[httpx.Response] = []

    def one() -> None:
        try:
            statuses.append(post(srv, CMPL, body, timeout=10))
        except httpx.TimeoutException:
            pass  # served slowly: its connection closes and the request is aborted

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    busy = [r for r in statuses if r.status_code == 429]
    assert busy, [r.status_code for r in statuses]
    assert all(r.status_code in (200, 429) for r in statuses)
    error = assert_error(busy[0], 429, None, "busy")
    assert error["type"] == "rate_limit_error"
    assert busy[0].headers["retry-after"] == "1"
    assert srv.metrics()["loom:num_requests_rejected_total"] >= len(busy)
    srv.wait_idle(120)


def _rss(server: ServerProcess) -> int:
    assert server.proc is not None
    return psutil.Process(server.proc.pid).memory_info().rss


def test_memory_comes_back_after_a_storm(srv: ServerProcess) -> None:
    """RSS after 3 rounds of every bad request stays within 100 MB of RSS after the first."""
    def storm() -> None:
        for _, path, body, *_ in FINDINGS:
            post(srv, path, body)

    storm()  # first round: caches and pools warm up
    before = _rss(srv)
    for _ in range(3):
        storm()
    after = _rss(srv)
    assert after - before < 100 * 2**20, (before, after)
    r = post(srv, CMPL, {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_still_serving(srv: ServerProcess) -> None:
    srv.wait_idle(120)
    r = post(srv, CMPL, {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
    assert srv.alive
