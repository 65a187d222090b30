"""Structured output and tool calling through the real server and the official `openai` client,
on the packaged SmolLM2."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import OpenAI

from loom.tools.parsers import MAX_PARALLEL_CALLS

pytestmark = pytest.mark.slow  # real `loom serve` subprocesses

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
}, "required": ["name", "age"]}

ASK = [{"role": "user", "content": "Describe a fictional programmer as JSON."}]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}},
                       "required": ["tz"]}}},
]
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_json_schema_response_format(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=None, messages=ASK, max_tokens=120, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    person = json.loads(choice.message.content)
    jsonschema.validate(person, PERSON)
    assert set(person) <= set(PERSON["properties"])


def test_json_object_response_format(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=None, max_tokens=80, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a key 'color'."}],
    )
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut at max_tokens: still a JSON object's beginning
        assert content.startswith("{")


def test_completions_extras_regex_choice_grammar(client: OpenAI) -> None:
    r = client.completions.create(model=None, prompt="Call me at", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}})
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text)
    r = client.completions.create(model=None, prompt="Is the sky blue? Answer:", max_tokens=5,
                                  extra_body={"guided_choice": ["yes", "no"]}, n=3, seed=1)
    assert all(c.text in ("yes", "no") for c in r.choices)
    grammar = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    r = client.completions.create(model=None, prompt="What is 6 times 7?", max_tokens=20,
                                  temperature=0, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", r.choices[0].text)


def test_streamed_json_schema_is_valid(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=None, messages=ASK, max_tokens=120, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid(client: OpenAI, tool_choice) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model=None, messages=WEATHER_Q, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=300, temperature=0.8, seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert 1 <= len(calls) <= MAX_PARALLEL_CALLS
        assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in calls] == ["get_time"]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))


def _reassemble(stream) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content, calls, finish = None, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            if tc.id:
                assert entry["id"] is None  # the id comes once, with the name
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("tool_choice, max_tokens", [
    ("required", 150), ("auto", 150),
    ({"type": "function", "function": {"name": "get_weather"}}, 150),
    ("required", 22),  # cut short inside the call (its name written by the 16th token)
])
def test_streamed_tool_calls_reassemble_to_the_whole_answer(client: OpenAI, tool_choice,
                                                            max_tokens) -> None:
    """The stream's deltas add up to the whole answer, also when max_tokens cuts a call short:
    the calls read so far (the last one's arguments as written), finish "length"; the fuzzing
    found the stream sending a partial call and then the whole text as content, and the whole
    answer the text alone."""
    kwargs = dict(model=None, messages=WEATHER_Q, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=max_tokens, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = _reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert finish == whole.finish_reason
    assert content == whole.message.content
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert calls == expected
    if max_tokens < 150:
        assert finish == "length" and expected and expected[0][0] == "get_weather"
        assert "<tool_call>" not in (content or "")
    elif tool_choice != "auto":
        assert expected and finish == "tool_calls"


def test_tool_results_round_trip(client: OpenAI, server) -> None:
    first = client.chat.completions.create(
        model=None, messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=150,
        temperature=0,
    ).choices[0].message
    call = first.tool_calls[0]
    messages = [*WEATHER_Q,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=None, messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=30, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    # The tool result and the earlier call are in the prompt the model saw.
    import httpx

    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt
    assert f'"name": "{call.function.name}"' in prompt


def test_tool_choice_none_answers_in_text(client: OpenAI) -> None:
    r = client.chat.completions.create(model=None, messages=WEATHER_Q, tools=TOOLS,
                                       tool_choice="none", max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content
