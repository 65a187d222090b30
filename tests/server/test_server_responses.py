"""POST /v1/responses (OpenAI's Responses API) through the real server and the official
`openai` client: a response is the chat completion it stands for (same text, same usage);
streamed events are well formed and add up to the whole response; previous_response_id
continues the stored conversation; function calls and their outputs round-trip; text.format
constrains; unsupported parameters are 400s, unknown ids 404s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

ASK = "What is the capital of France?"
RULES = "Answer in one short sentence."
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                   "maxLength": 20}},
                         "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                 if k != "type"}}]


def _chat(client: OpenAI, messages: list[dict], **kwargs) -> tuple[str, int, int]:
    out = client.chat.completions.create(model=None, messages=messages, temperature=0,
                                         **kwargs)
    return (out.choices[0].message.content, out.usage.prompt_tokens,
            out.usage.completion_tokens)


def test_a_response_is_its_chat_completion(client: OpenAI) -> None:
    r = client.responses.create(model=None, input=ASK, instructions=RULES,
                                max_output_tokens=24, temperature=0)
    text, prompt, completion = _chat(client, [{"role": "system", "content": RULES},
                                              {"role": "user", "content": ASK}],
                                     max_completion_tokens=24)
    assert r.object == "response" and r.id.startswith("resp") and r.status == "completed"
    assert r.output_text == text and "Paris" in text
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt, completion)
    assert r.usage.total_tokens == prompt + completion
    assert r.instructions == RULES and r.max_output_tokens == 24 and r.temperature == 0


def test_streamed_events_add_up_to_the_response(client: OpenAI) -> None:
    whole = client.responses.create(model=None, input=ASK, max_output_tokens=24,
                                    temperature=0)
    events = list(client.responses.create(model=None, input=ASK, max_output_tokens=24,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(model=None, input=ASK, max_output_tokens=24,
                                 temperature=0) as stream:  # the SDK's own accumulator
        assert stream.get_final_response().output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(client: OpenAI) -> None:
    first = client.responses.create(model=None, input=ASK, max_output_tokens=24,
                                    temperature=0, instructions=RULES)
    then = "And of Germany?"
    second = client.responses.create(model=None, input=then, previous_response_id=first.id,
                                     max_output_tokens=24, temperature=0)
    # the earlier input and output come first, its instructions do not (OpenAI's rule)
    text, _, _ = _chat(client, [{"role": "user", "content": ASK},
                                {"role": "assistant", "content": first.output_text},
                                {"role": "user", "content": then}], max_completion_tokens=24)
    assert second.output_text == text and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=None, input=ASK, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=None, input=then, previous_response_id=unstored.id)


def test_function_calls_and_their_outputs(client: OpenAI) -> None:
    r = client.responses.create(model=None, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    events = list(client.responses.create(
        model=None, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60, temperature=0, stream=True))
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments == events[-1].response.output[-1].arguments
    # the call and its output sent back: the chat completion of the same turns
    back = client.responses.create(model=None, tools=TOOLS, max_output_tokens=24, temperature=0,
                                   input=[{"role": "user", "content": "Weather in Paris?"},
                                          call.model_dump(exclude_none=True),
                                          {"type": "function_call_output",
                                           "call_id": call.call_id, "output": "18 C"}])
    text, _, _ = _chat(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}],
        tools=CHAT_TOOLS, max_completion_tokens=24)
    assert back.output_text == text


def test_text_format_and_max_output_tokens(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"]}
    r = client.responses.create(model=None, input="Name a famous scientist, as JSON.",
                                max_output_tokens=40, temperature=0, text={"format": {
                                    "type": "json_schema", "name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    cut = client.responses.create(model=None, input="Write a long poem about the sea.",
                                  max_output_tokens=5, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5


@pytest.mark.parametrize("body, param", [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
])
def test_unsupported_or_bad_fields_are_400s(client: OpenAI, body: dict, param: str) -> None:
    kwargs = {"model": None, "input": "hi", **body}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kwargs)
    assert param in str(e.value.body.get("param") or e.value.message)
