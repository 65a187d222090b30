"""Tool calls in LFM2's pythonic format through `loom serve` and the official client: a tiny
random LFM2 (a hybrid: short convolutions beside attention) whose tokenizer (SmolLM2's) holds
`<|tool_call_start|>` / `<|tool_call_end|>` as special tokens, as LFM2's does, served with
LFM2.5's real template. A forced call comes out as `[name(key=value)]` between the markers
(matched by token id), is read back as JSON arguments, goes back through the template in the
next turn, and streams to the same call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

TEMPLATE = (Path(__file__).resolve().parents[1] / "data" / "chat_templates"
            / "LFM2.5-8B-A1B.jinja")
MARKERS = ["<|tool_call_start|>", "<|tool_call_end|>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 12}},
        "required": ["city", "metric"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> OpenAI:
    from tests.tiny_models import make_tiny_chat_model, smollm2_tokenizer

    hf = smollm2_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": MARKERS})
    hf.chat_template = TEMPLATE.read_text()
    folder = make_tiny_chat_model("lfm2", tmp_path_factory.mktemp("lfm2") / "tiny", hf,
                                  vocab_size=len(hf), max_position_embeddings=2048)
    server = start_server([str(folder), "--max-model-len", "2048", "--dtype", "float32",
                           "--served-model-name", "tiny"])
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_forced_pythonic_call_and_back(client: OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                         tool_choice="required", max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and isinstance(args["metric"], bool)
    assert not choice.message.content  # the markers and the list are not content
    follow = client.chat.completions.create(
        model="tiny", tools=TOOLS, max_tokens=5, temperature=0, messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_pythonic_call_equals_the_whole_answer(client: OpenAI) -> None:
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    name, args, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or ():
                assert d.index == 0
                name += d.function.name or ""
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert (name, args) == (call.function.name, call.function.arguments)
