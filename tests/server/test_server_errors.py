"""Bad requests over raw HTTP: the exact status, error type and param of each, and the server
keeps serving afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.utils import ServerProcess

pytestmark = pytest.mark.slow  # real `loom serve` subprocesses

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "hello " * 1100  # > max_model_len (1024) tokens

# (name, method, path, body (dict -> JSON, str -> raw bytes), status, type, param)
BAD_REQUESTS: list[tuple[str, str, str, Any, int, str, str | None]] = [
    ("malformed json", "POST", CMPL, '{"prompt": "hi",', 400, "invalid_request_error", None),
    ("body not an object", "POST", CMPL, "[1, 2]", 400, "invalid_request_error", None),
    ("empty body", "POST", CMPL, "", 400, "invalid_request_error", None),
    ("missing prompt", "POST", CMPL, {"max_tokens": 3}, 400, "invalid_request_error", "prompt"),
    ("prompt wrong type", "POST", CMPL, {"prompt": 5}, 400, "invalid_request_error", "prompt"),
    ("empty prompt list", "POST", CMPL, {"prompt": []}, 400, "invalid_request_error", "prompt"),
    ("empty prompt text", "POST", CMPL, {"prompt": ""}, 400, "invalid_request_error", "prompt"),
    ("token id out of vocab", "POST", CMPL, {"prompt": [10**7]}, 400,
     "invalid_request_error", "prompt"),
    ("max_tokens string", "POST", CMPL, {"prompt": "hi", "max_tokens": "5"}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens bool", "POST", CMPL, {"prompt": "hi", "max_tokens": True}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens negative", "POST", CMPL, {"prompt": "hi", "max_tokens": -1}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens zero", "POST", CMPL, {"prompt": "hi", "max_tokens": 0}, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens huge", "POST", CMPL, {"prompt": "hi", "max_tokens": 10**9}, 400,
     "invalid_request_error", "max_tokens"),
    ("prompt over max_model_len", "POST", CMPL, {"prompt": LONG_PROMPT}, 400,
     "invalid_request_error", "prompt"),
    ("temperature too high", "POST", CMPL, {"prompt": "hi", "temperature": 2.5}, 400,
     "invalid_request_error", "temperature"),
    ("temperature negative", "POST", CHAT, {"messages": USER, "temperature": -0.1}, 400,
     "invalid_request_error", "temperature"),
    ("top_p zero", "POST", CMPL, {"prompt": "hi", "top_p": 0}, 400, "invalid_request_error",
     "top_p"),
    ("presence_penalty out of range", "POST", CMPL, {"prompt": "hi", "presence_penalty": 3},
     400, "invalid_request_error", "presence_penalty"),
    ("n too large", "POST", CMPL, {"prompt": "hi", "n": 1000}, 400, "invalid_request_error",
     "n"),
    ("n zero", "POST", CHAT, {"messages": USER, "n": 0}, 400, "invalid_request_error", "n"),
    ("logprobs too large", "POST", CMPL, {"prompt": "hi", "logprobs": 21}, 400,
     "invalid_request_error", "logprobs"),
    ("logit_bias bad key", "POST", CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, 400,
     "invalid_request_error", "logit_bias"),
    ("logit_bias out of vocab", "POST", CMPL, {"prompt": "hi", "logit_bias": {"99999999": 1}},
     400, "invalid_request_error", "logit_bias"),
    ("logit_bias value", "POST", CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, 400,
     "invalid_request_error", "logit_bias"),
    ("stop wrong type", "POST", CMPL, {"prompt": "hi", "stop": 5}, 400,
     "invalid_request_error", "stop"),
    ("suffix rejected", "POST", CMPL, {"prompt": "hi", "suffix": "end"}, 400,
     "invalid_request_error", "suffix"),
    ("best_of rejected", "POST", CMPL, {"prompt": "hi", "best_of": 2}, 400,
     "invalid_request_error", "best_of"),
    ("unknown field", "POST", CMPL, {"prompt": "hi", "frobnicate": 1}, 400,
     "invalid_request_error", "frobnicate"),
    ("stream_options without stream", "POST", CMPL,
     {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "invalid_request_error", "stream_options"),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "invalid_request_error",
     "messages"),
    ("missing messages", "POST", CHAT, {"max_tokens": 3}, 400, "invalid_request_error",
     "messages"),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "invalid_request_error", "messages[0].role"),
    ("image content part", "POST", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "invalid_request_error", "messages[0].content[0].type"),
    ("content wrong type", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_request_error", "messages[0].content"),
    ("tools empty", "POST", CHAT, {"messages": USER, "tools": []}, 400,
     "invalid_request_error", "tools"),
    ("tool without function", "POST", CHAT, {"messages": USER, "tools": [{"type": "function"}]},
     400, "invalid_request_error", "tools[0].function"),
    ("tool name with spaces", "POST", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "get weather"}}]}, 400,
     "invalid_request_error", "tools[0].function.name"),
    ("tool_choice without tools", "POST", CHAT, {"messages": USER, "tool_choice": "required"},
     400, "invalid_request_error", "tool_choice"),
    ("tool_choice unknown function", "POST", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, 400, "invalid_request_error",
     "tool_choice"),
    ("tool parameters not a schema", "POST", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
        "tool_choice": "required"}, 400, "invalid_request_error", "tools"),
    ("json_schema without schema", "POST", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "invalid_request_error",
     "response_format"),
    ("response_format unknown type", "POST", CHAT, {"messages": USER, "response_format": {
        "type": "yaml"}}, 400, "invalid_request_error", "response_format.type"),
    ("invalid json schema", "POST", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 400,
     "invalid_request_error", "response_format"),
    ("invalid regex", "POST", CMPL, {"prompt": "hi", "structured_outputs": {"regex": "a(b"}},
     400, "invalid_request_error", "structured_outputs"),
    ("invalid grammar", "POST", CMPL, {"prompt": "hi", "guided_grammar": "start: nope"}, 400,
     "invalid_request_error", "guided_grammar"),
    ("two constraints", "POST", CMPL, {"prompt": "hi", "guided_regex": "a+",
     "guided_choice": ["x"]}, 400, "invalid_request_error", "guided_choice"),
    ("empty choice", "POST", CMPL, {"prompt": "hi", "guided_choice": []}, 400,
     "invalid_request_error", "guided_choice"),
    ("structured_outputs unknown key", "POST", CMPL, {"prompt": "hi", "structured_outputs": {
        "regexp": "a"}}, 400, "invalid_request_error", "structured_outputs.regexp"),
    ("top_logprobs without logprobs", "POST", CHAT, {"messages": USER, "top_logprobs": 2},
     400, "invalid_request_error", "top_logprobs"),
    ("top_logprobs too large", "POST", CHAT,
     {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "invalid_request_error",
     "top_logprobs"),
    ("chat max_completion_tokens huge", "POST", CHAT,
     {"messages": USER, "max_completion_tokens": 5000}, 400, "invalid_request_error",
     "max_completion_tokens"),
    ("chat max_tokens huge", "POST", CHAT, {"messages": USER, "max_tokens": 5000}, 400,
     "invalid_request_error", "max_tokens"),
    ("priority under fcfs", "POST", CMPL, {"prompt": "hi", "priority": 1}, 400,
     "invalid_request_error", "priority"),
    ("priority under fcfs chat", "POST", CHAT, {"messages": USER, "priority": -2}, 400,
     "invalid_request_error", "priority"),
    ("priority not an integer", "POST", CMPL, {"prompt": "hi", "priority": 1.5}, 400,
     "invalid_request_error", "priority"),
    ("unknown model", "POST", CMPL, {"prompt": "hi", "model": "gpt-4"}, 404,
     "not_found_error", "model"),
    ("unknown model chat", "POST", CHAT, {"messages": USER, "model": "nope"}, 404,
     "not_found_error", "model"),
    ("unknown route", "POST", "/v1/nothing", {"input": "x"}, 404, "not_found_error", None),
    ("unknown route get", "GET", "/nothing/here", None, 404, "not_found_error", None),
    ("wrong method", "GET", CMPL, None, 405, "invalid_request_error", None),
    ("detokenize out of vocab", "POST", "/detokenize", {"tokens": [-1]}, 400,
     "invalid_request_error", "tokens"),
    ("tokenize needs one input", "POST", "/tokenize", {}, 400, "invalid_request_error",
     "prompt"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "error_type", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request(server: ServerProcess, method: str, path: str, body: Any, status: int,
                     error_type: str, param: str | None) -> None:
    kwargs: dict[str, Any] = {}
    if isinstance(body, str):
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": body}
    r = httpx.request(method, f"{server.url}{path}", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["param"] == param, error
    assert error["message"]


def test_still_serving_after_bad_requests(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}{CMPL}", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
