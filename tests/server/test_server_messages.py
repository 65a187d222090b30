"""POST /v1/messages (Anthropic's Messages API) through the real server and Anthropic's
official client: a message is its chat completion (same text and tokens); streamed events add
up to the whole message; tool_use and tool_result round-trip; stop sequences, max_tokens,
output_config's JSON schema and count_tokens; errors in Anthropic's envelope; `x-api-key`."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from tests.server.conftest import start_server
from tests.server.utils import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}  # (the current API has no temperature: the older one's field)
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                     "maxLength": 20}},
                           "required": ["city"]}}]


MODEL = "smollm2"  # the served model's name (tests/server/utils.py's servers)


@pytest.fixture(scope="module")
def claude(server: ServerProcess, model_name: str) -> anthropic.Anthropic:
    assert model_name == MODEL
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_message_is_its_chat_completion(claude: anthropic.Anthropic, client: OpenAI) -> None:
    m = claude.messages.create(model=MODEL, max_tokens=24, system="Answer briefly.",
                               messages=ASK, extra_body=GREEDY)
    chat = client.chat.completions.create(
        model=None, max_completion_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, *ASK])
    (block,) = m.content
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat.choices[0].finish_reason]
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    counted = claude.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_add_up_to_the_message(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=ASK,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in claude.messages.create(model=MODEL, max_tokens=24, messages=ASK,
                                                    stream=True, extra_body=GREEDY)]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_use_and_tool_result(claude: anthropic.Anthropic, client: OpenAI) -> None:
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, TOOLS[0]["input_schema"])
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=[
            {"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    back = claude.messages.create(model=MODEL, max_tokens=24, tools=TOOLS, extra_body=GREEDY,
                                  messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 C"}]}])
    chat = client.chat.completions.create(model=None, max_completion_tokens=24, temperature=0,
                                          tools=[{"type": "function", "function": {
                                              "name": "get_weather", "description": TOOLS[0][
                                                  "description"],
                                              "parameters": TOOLS[0]["input_schema"]}}],
                                          messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": use.id, "type": "function",
            "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C"}])
    assert back.content[0].text == chat.choices[0].message.content


def test_stops_limits_and_json_output(claude: anthropic.Anthropic) -> None:
    free = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    word = free.content[0].text.split()[2]  # stop at the reply's third word
    stopped = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK,
                                     stop_sequences=[word], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"]}
    js = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Name a scientist, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(js.content[0].text), schema)


def test_errors_are_anthropics(claude: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    for kwargs in ({"messages": [{"role": "user", "content": [image]}]},
                   {"messages": ASK, "output_config": {"effort": "high"}},
                   {"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
                   {"messages": []}):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=MODEL, max_tokens=8, **kwargs)
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"


def test_x_api_key_is_accepted() -> None:
    server = start_server([*ENGINE_ARGS, "--api-key", "sekret"])
    ok = anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0)
    assert ok.messages.create(model=MODEL, max_tokens=2, messages=ASK).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0
                            ).messages.create(model=MODEL, max_tokens=2, messages=ASK)
