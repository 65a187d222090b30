"""The API under a fuzzer (issue 25): hypothesis strategies over the request models' fields,
mixing valid values with hostile ones (integers past 64 bits, NaN and infinities, lone
surrogates, deep nesting, wrong types, unknown fields), sent to the real server. Every answer
is below 500 and in the error envelope when it is an error, nothing hangs, and the server gives
the same greedy completion afterwards as before; the same for /v1/responses and /v1/messages
(each in its own error envelope). Also: /health answers within a second while the largest
accepted body is tokenized."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.utils import ServerProcess

pytestmark = pytest.mark.slow

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
REFERENCE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}

_huge_int = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**19, -(10**30), 2**200])
_odd_float = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1e-308])
_surrogate = st.sampled_from(["x\ud800y", "\udfff", "ok\ud83d"])
_deep = st.integers(60, 3000).map(lambda d: "[" * d + "]" * d)
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5))
_junk = st.one_of(
    _json_leaf, _huge_int, _odd_float, _surrogate, _deep,
    st.integers(20, 200).map(lambda d: json.loads("[" * d + "]" * d)),
    st.lists(_json_leaf, max_size=3), st.dictionaries(st.text(max_size=4), _json_leaf, max_size=3),
)


def _field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes anything at all."""
    return st.one_of(valid, valid, valid, _junk)


_text = st.one_of(st.text(max_size=40), st.sampled_from(["Hello", "1 + 1 =", "Once upon"]))
_sampling = {
    "max_tokens": _field(st.integers(-2, 6)),
    "temperature": _field(st.floats(0, 2.2)),
    "top_p": _field(st.floats(0, 1)),
    "top_k": _field(st.one_of(st.integers(-2, 100), _huge_int)),
    "min_p": _field(st.floats(0, 1)),
    "seed": _field(st.one_of(st.integers(-(2**63), 2**63 - 1), _huge_int)),
    "n": _field(st.integers(0, 3)),
    "stop": _field(st.one_of(_text, st.lists(_text, max_size=4))),
    "stop_token_ids": _field(st.lists(st.integers(-1, 60000), max_size=3)),
    "logit_bias": _field(st.dictionaries(st.integers(-1, 60000).map(str),
                                         st.floats(-110, 110), max_size=3)),
    "presence_penalty": _field(st.floats(-2.5, 2.5)),
    "frequency_penalty": _field(st.floats(-2.5, 2.5)),
    "repetition_penalty": _field(st.floats(0, 2.5)),
    "min_tokens": _field(st.integers(-1, 4)),
    "ignore_eos": _field(st.booleans()),
    "stream": _field(st.booleans()),
    "logprobs": _field(st.integers(-1, 21)),
    "guided_regex": _field(st.sampled_from(["[ab]{1,3}", "a(b", "((a{100}){100}){100}"])),
    "guided_choice": _field(st.lists(_text, max_size=3)),
    "guided_json": _field(st.sampled_from([{"type": "object"}, {"type": "nope"}, "{"])),
    "response_format": _field(st.sampled_from([{"type": "json_object"}, {"type": "text"}])),
    "frobnicate": _junk,
}
_prompt = st.one_of(_text, st.lists(_text, max_size=3), st.lists(st.integers(-1, 60000),
                                                                 max_size=6), _surrogate)
_message = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["user", "system", "assistant"])), "content": _field(_text)})


def _body(required: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    optional = st.fixed_dictionaries({}, optional=_sampling)
    return st.tuples(st.fixed_dictionaries(required), optional).map(lambda t: {**t[1], **t[0]})


REQUESTS = st.one_of(
    st.tuples(st.just(CMPL), _body({"prompt": _field(_prompt)})),
    # (a chat without a token limit would generate up to max_model_len: slow, not hostile)
    st.tuples(st.just(CHAT), _body({"messages": _field(st.lists(_message, min_size=1,
                                                                 max_size=3)),
                                     "max_completion_tokens": st.integers(1, 6)})),
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries({"prompt": _field(_text)})),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries(
        {"tokens": _field(st.lists(st.one_of(st.integers(-1, 60000), _huge_int), max_size=4))})),
)


def _check(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    content = json.dumps(body)  # NaN/Infinity and lone surrogates as JSON text would carry them
    with httpx.stream("POST", f"{server.url}{path}", content=content, timeout=120,
                      headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (path, content[:300], text[:300])
    if r.status_code >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, text
    elif text.startswith("data:"):
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        assert '"server_error"' not in text, text[-300:]


def _reference(server: ServerProcess) -> str:
    r = httpx.post(f"{server.url}{CMPL}", json=REFERENCE, timeout=120)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def test_fuzz_no_server_errors(server: ServerProcess) -> None:
    before = _reference(server)

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(REQUESTS)
    def fuzz(request: tuple[str, dict[str, Any]]) -> None:
        _check(server, *request)

    fuzz()
    assert server.alive
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    server.wait_idle(120)
    assert _reference(server) == before


# /v1/responses and /v1/messages (serving_responses.py, serving_messages.py): their own fields
_tool = st.sampled_from([{"type": "function", "name": "f", "parameters": {"type": "object"}},
                         {"type": "web_search"}, {"type": "function", "name": "bad name"}])
_response_item = st.one_of(
    _message,
    st.fixed_dictionaries({"role": _field(st.sampled_from(["user", "assistant", "developer"])),
                           "content": st.lists(st.fixed_dictionaries({
                               "type": st.sampled_from(["input_text", "output_text",
                                                        "input_image"]),
                               "text": _field(_text)}), max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": _field(_text),
                           "name": _field(_text), "arguments": _field(
                               st.sampled_from(["{}", '{"a": 1}', "{", "[1]"]))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _field(_text),
                           "output": _field(_text)}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([])}),
    _junk)
_responses_fields = {
    "instructions": _field(_text), "temperature": _field(st.floats(0, 2.2)),
    "top_p": _field(st.floats(0, 1)), "stream": _field(st.booleans()),
    "tools": _field(st.lists(_tool, max_size=2)),
    "tool_choice": _field(st.sampled_from(["auto", "required", "none",
                                           {"type": "function", "name": "f"},
                                           {"type": "function", "name": "g"}])),
    "text": _field(st.sampled_from([{"format": {"type": "json_object"}},
                                    {"format": {"type": "json_schema", "name": "x",
                                                "schema": {"type": "object"}}},
                                    {"format": {"type": "json_schema"}}])),
    "previous_response_id": _field(_text), "store": _field(st.booleans()),
    "metadata": _field(st.dictionaries(st.text(max_size=3), _text, max_size=2)),
    "reasoning": _junk,
}
_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _field(_text)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": _field(_text),
                           "name": _field(_text), "input": _field(st.just({"a": 1}))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": _field(_text),
                           "content": _field(_text)}),
    st.fixed_dictionaries({"type": st.just("image"), "source": _junk}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": _field(_text)}))
_turn = st.fixed_dictionaries({"role": _field(st.sampled_from(["user", "assistant"])),
                               "content": _field(st.one_of(_text, st.lists(_block,
                                                                           max_size=3)))})
_messages_fields = {
    "system": _field(_text), "stream": _field(st.booleans()),
    "stop_sequences": _field(st.lists(_text, max_size=2)),
    "temperature": _field(st.floats(0, 2.2)), "top_k": _field(st.integers(-2, 50)),
    "tools": _field(st.lists(st.sampled_from([{"name": "f", "input_schema": {"type": "object"}},
                                              {"name": "f"}]), max_size=2)),
    "tool_choice": _field(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool"},
                                           {"type": "tool", "name": "f"}, {"type": "none"}])),
    "output_config": _field(st.sampled_from([{"format": {"type": "json_schema",
                                                         "schema": {"type": "object"}}},
                                             {"effort": "high"}])),
    "thinking": _junk, "model": _field(st.sampled_from(["smollm2", "claude"])),
}
_clean_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                        "content": _text.filter(bool)})
_CLEAN = st.one_of(  # valid requests of every shape: the paths that answer 200
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries(
        {"input": st.one_of(_text.filter(bool), st.lists(_clean_message, min_size=1,
                                                          max_size=2)),
         "max_output_tokens": st.integers(1, 6), "stream": st.booleans()},
        optional={"tools": st.just([{"type": "function", "name": "f",
                                     "parameters": {"type": "object"}}]),
                  "tool_choice": st.sampled_from(["auto", "required"]),
                  "text": st.just({"format": {"type": "json_object"}})})),
    st.tuples(st.just("/v1/messages"), st.fixed_dictionaries(
        {"messages": st.lists(_clean_message, min_size=1, max_size=2),
         "max_tokens": st.integers(1, 6), "stream": st.booleans()},
        optional={"tools": st.just([{"name": "f", "input_schema": {"type": "object"}}]),
                  "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}]),
                  "stop_sequences": st.lists(_text, max_size=2)})),
)
NEW_APIS = st.one_of(
    _CLEAN,
    st.tuples(st.just("/v1/responses"), st.tuples(
        st.fixed_dictionaries({"input": _field(st.one_of(_text, st.lists(_response_item,
                                                                          max_size=4))),
                               "max_output_tokens": st.integers(1, 6)}),
        st.fixed_dictionaries({}, optional=_responses_fields)).map(lambda t: {**t[1], **t[0]})),
    st.tuples(st.just("/v1/messages"), st.tuples(
        st.fixed_dictionaries({"messages": _field(st.lists(_turn, min_size=1, max_size=3)),
                               "max_tokens": st.integers(1, 6)}),
        st.fixed_dictionaries({}, optional=_messages_fields)).map(lambda t: {**t[1], **t[0]})),
)


def _check_new(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    """As _check, with each API's own error envelope and stream ending."""
    content = json.dumps(body)
    with httpx.stream("POST", f"{server.url}{path}", content=content, timeout=120,
                      headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (path, content[:300], text[:300])
    anthropic = path == "/v1/messages"
    if r.status_code >= 400:
        error = json.loads(text)
        if anthropic:
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}, text
    elif text.startswith("event:"):
        last = text.rstrip().rsplit("\n", 1)[-1]
        ends = ("message_stop", "error") if anthropic else (
            "response.completed", "response.incomplete", "error")
        assert any(f'"type":"{e}"' in last for e in ends), text[-300:]
        assert "server_error" not in text and "api_error" not in text, text[-300:]


def test_fuzz_responses_and_messages(server: ServerProcess) -> None:
    """The fuzzer on OpenAI's Responses API and Anthropic's Messages API: no 5xx, each API's
    own error envelope, streams that end as the API ends them, the server unharmed."""
    before = _reference(server)

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(NEW_APIS)
    def fuzz(request: tuple[str, dict[str, Any]]) -> None:
        _check_new(server, *request)

    fuzz()
    assert server.alive
    server.wait_idle(120)
    assert _reference(server) == before


def test_health_answers_while_the_largest_body_is_tokenized(server: ServerProcess) -> None:
    """~16 MiB of prompts (each at the character bound) are tokenized on a worker thread;
    /health answers every poll within its own 1 s timeout meanwhile."""
    one = "\n" + " " * 80  # one token of 81 characters, the longest in the vocabulary
    # As many prompts as the waiting queue takes, each near the character bound (1000
    # tokens), the last one too long once tokenized: a 400 after all of them are tokenized.
    count = min(190, int(server.metrics()["loom:max_waiting_requests"]))
    prompts = [one * 1000] * (count - 1) + [one * 1000 + "x" * 1000]
    body = json.dumps({"prompt": prompts, "max_tokens": 1})
    assert len(body) < 16 * 2**20
    result: dict[str, httpx.Response] = {}
    rss_before = _rss(server)
    big = threading.Thread(target=lambda: result.update(r=httpx.post(
        f"{server.url}{CMPL}", content=body, timeout=600,
        headers={"content-type": "application/json"})))
    big.start()
    polls = 0
    while big.is_alive():
        r = httpx.get(f"{server.url}/health", timeout=1.0)  # raises if it takes over 1 s
        assert r.status_code == 200
        polls += 1
    big.join()
    assert polls >= 3
    r = result["r"]
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == f"prompt[{count - 1}]"
    growth = _rss(server) - rss_before  # the memory of all those token ids came back
    print(f"{count} prompts, {len(body)} bytes, {polls} polls, RSS {growth / 2**20:+.0f} MiB")
    assert growth < 100 * 2**20


def _rss(server: ServerProcess) -> int:
    assert server.proc is not None
    return psutil.Process(server.proc.pid).memory_info().rss


