"""Tool calls in a model's own format through `loom serve`, driven by the official client,
for two formats: Mistral's (a tiny random Llama whose tokenizer, SmolLM2's, holds
`[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` as special tokens, as Mistral's do, served with
Mistral Small 3.2's real template) and the pythonic one (a tiny random LFM2, a hybrid, whose
tokenizer holds `<|tool_call_start|>` / `<|tool_call_end|>` as special tokens, served with
LFM2.5's real template). Forced calls come out in the format (the markers matched by token id),
are parsed with their special tokens kept in the text (Mistral's carry 9-character ids), go back
through the template in the next turn (Mistral's refuses any other id), and stream to the whole
answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# format -> (the model's template, the markers its tokenizer holds, the tiny architecture)
FORMATS = {
    "mistral": ("Mistral-Small-3.2-24B-Instruct-2506.jinja",
                ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"], "llama"),
    "pythonic": ("LFM2.5-8B-A1B.jinja", ["<|tool_call_start|>", "<|tool_call_end|>"], "lfm2"),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module", params=list(FORMATS))
def client(request, tmp_path_factory) -> tuple[str, OpenAI]:
    from tests.tiny_models import make_tiny_chat_model, smollm2_tokenizer

    template, markers, arch = FORMATS[request.param]
    hf = smollm2_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": markers})
    hf.chat_template = (TEMPLATES / template).read_text()
    folder = make_tiny_chat_model(arch, tmp_path_factory.mktemp(request.param) / "tiny", hf,
                                  vocab_size=len(hf), max_position_embeddings=2048)
    server = start_server([str(folder), "--max-model-len", "2048", "--dtype", "float32",
                           "--served-model-name", "tiny"])
    return request.param, OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120,
                                 max_retries=0)


def test_forced_call_in_the_format_and_back(client: tuple[str, OpenAI]) -> None:
    fmt, client = client
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                         tool_choice="required", max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and isinstance(args["metric"], bool)
    assert fmt != "mistral" or (len(call.id) == 9 and call.id.isalnum())
    assert not choice.message.content  # the markers are not content
    # the next turn: the call and its result rendered by the model's template (Mistral's: an
    # id of any other length is an error there, a 400)
    follow = client.chat.completions.create(
        model="tiny", tools=TOOLS, max_tokens=5, temperature=0, messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_call_equals_the_whole_answer(client: tuple[str, OpenAI]) -> None:
    fmt, client = client
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    name, args, ids, finish = "", "", set(), None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert not c.delta.content  # nothing of the call leaks into content
            for d in c.delta.tool_calls or ():
                assert d.index == 0
                if d.id:
                    ids.add(d.id)
                name += d.function.name or ""
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert (name, args) == (call.function.name, call.function.arguments)
    assert len(ids) == 1 and (fmt != "mistral" or all(len(i) == 9 for i in ids))
