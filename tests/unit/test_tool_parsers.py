"""Tool-call parsers on recorded model outputs and on what real chat templates write; streaming
views add up to the final view; the required-call grammars accept exactly well-formed calls;
tools reach templates that lack them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.tools.chat import prepare_conversation, template_supports_tools
from loom.tools.parsers import (
    PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCallView,
    parser_for_template,
)

# Outputs in the documented formats of Qwen2.5 / Hermes (<tool_call>) and Llama 3.1 (JSON).
HERMES_ONE = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"unit": "celsius"}}\n</tool_call>')
HERMES_TWO = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
              '{"tz": "Europe/Paris"}}\n</tool_call>')
HERMES_ARGS_FIRST = '<tool_call>\n{"arguments": {"q": "a \\"quoted\\" {x}"}, "name": "search"}\n</tool_call>'
HERMES_UNCLOSED = '<tool_call>\n{"name": "ping", "arguments": {}}'
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TAGGED_TWO = ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                    '{"name": "b", "parameters": {"y": [1, 2]}}')


# Recorded from SmolLM2-135M-Instruct (greedy, tools in the system prompt, tool_choice auto):
# it answers in prose or code, never a call, and none of it may be parsed as one.
SMOLLM2_AUTO = [
    "The weather in Paris right now is extremely hot and humid.",
    "The time in Tokyo is 12:30 PM.",
    "Here's a Python function that can help you:\n\n```python\ndef get_weather_time(city_name, "
    "time_zone=\"UTC\"):\n    return {\n        \"type\": \"function\",\n        \"function\": "
    "lambda: {\n            \"name\": \"get_weather_time\",",
]


def calls(view: ToolCallView) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in view.calls]


def test_hermes_recorded_outputs() -> None:
    p = HermesToolParser()
    v = p.view(HERMES_ONE, final=True)
    assert v.content == "" and calls(v) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    v = p.view(HERMES_TWO, final=True)
    assert v.content == "Let me check both."
    assert calls(v) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    v = p.view(HERMES_ARGS_FIRST, final=True)
    assert calls(v) == [("search", {"q": 'a "quoted" {x}'})]
    assert calls(p.view(HERMES_UNCLOSED, final=True)) == [("ping", {})]
    assert p.view("The weather is nice.", final=True) == ToolCallView("The weather is nice.")


@pytest.mark.parametrize("text", SMOLLM2_AUTO)
def test_recorded_prose_is_content(text: str) -> None:
    for parser in (HermesToolParser(), Llama3JsonToolParser()):
        assert parser.view(text, final=True) == ToolCallView(text)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # unbalanced
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    "<tool_call>\nnot json\n</tool_call>",
])
def test_hermes_malformed_is_plain_content(text: str) -> None:
    assert HermesToolParser().view(text, final=True) == ToolCallView(text)


def test_llama3_json_recorded_outputs() -> None:
    p = Llama3JsonToolParser()
    assert calls(p.view(LLAMA_ONE, final=True)) == [("get_weather", {"city": "Paris"})]
    assert calls(p.view(LLAMA_TAGGED_TWO, final=True)) == [("a", {"x": 1}), ("b", {"y": [1, 2]})]
    assert p.view("Paris is sunny.", final=True) == ToolCallView("Paris is sunny.")
    assert p.view('{"name": "f", "parameters": {', final=True).calls == []


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), HERMES_ONE), (HermesToolParser(), HERMES_TWO),
    (HermesToolParser(), HERMES_ARGS_FIRST), (HermesToolParser(), "Just text, no <b>tags</b>."),
    (Llama3JsonToolParser(), LLAMA_TAGGED_TWO), (Llama3JsonToolParser(), "Plain answer."),
])
def test_streamed_views_reassemble_to_the_final_view(parser, text) -> None:
    assert_streams_to_the_final_view(parser, text)


def assert_streams_to_the_final_view(parser, text: str) -> None:
    """Every prefix's view extends the previous one, and the last equals the final view."""
    content, args = "", {}
    names: dict[int, str] = {}
    for end in range(1, len(text) + 1):
        view = parser.view(text[:end], final=end == len(text))
        assert view.content.startswith(content)
        content = view.content
        for i, call in enumerate(view.calls):
            assert names.setdefault(i, call.name) == call.name
            assert call.arguments.startswith(args.get(i, ""))
            args[i] = call.arguments
    final = parser.view(text, final=True)
    assert content == final.content
    assert [(names[i], args[i]) for i in range(len(names))] == [
        (c.name, c.arguments) for c in final.calls]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]


@pytest.fixture(scope="module")
def compile_grammar():
    from loom.loader.resolve import resolve_model
    from loom.structured.manager import StructuredOutputManager
    from loom.structured.params import StructuredOutputsParams
    from loom.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None))
    manager = StructuredOutputManager(tok, tok.vocab_size)

    def accepts(grammar: str, text: str) -> bool:
        m = manager.compile(StructuredOutputsParams(grammar=grammar)).matcher()
        ok = all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and m.is_accepting()

    return accepts


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()])
def test_required_grammar_accepts_only_valid_calls(compile_grammar, parser) -> None:
    grammar = parser.grammar(TOOLS, parallel=True)
    good = parser.render_call("get_weather", {"city": "Oslo", "unit": "celsius"})
    assert compile_grammar(grammar, good)
    assert not compile_grammar(grammar, parser.render_call("get_weather", {"unit": "celsius"}))
    assert not compile_grammar(grammar, parser.render_call("launch", {"city": "Oslo"}))
    assert not compile_grammar(grammar, parser.render_call("get_time", {"tz": 3}))
    many = ("\n" if parser.name == "hermes" else "; ").join([good] * 5)
    assert compile_grammar(grammar, many.rsplit(good, 1)[0].rstrip("\n; "))  # 4 calls
    assert not compile_grammar(grammar, many)  # 5 > MAX_PARALLEL_CALLS
    single = parser.grammar(TOOLS[1:], parallel=False)
    assert compile_grammar(single, parser.render_call("get_time", {"tz": "UTC"}))
    assert not compile_grammar(single, good)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n'}}{% endfor %}")


def test_tools_reach_a_template_without_tool_support() -> None:
    assert not template_supports_tools(CHATML)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    out, tools = prepare_conversation(messages, TOOLS, CHATML, HermesToolParser())
    assert tools is None
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Paris"}}\n</tool_call>')
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n"
                      "<tool_response>\nsunny\n</tool_response>"}
    assert len(out) == 4


def test_native_template_gets_tools_and_dict_arguments() -> None:
    template = "{% if tools %}{{ tools | tojson }}{% endif %}{{ m.tool_calls }}<tool_call>"
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type":
                 "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    out, tools = prepare_conversation(messages, TOOLS, template, HermesToolParser())
    assert tools == TOOLS
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    # a template that lists tools but writes no assistant calls gets them as content
    lists_only = "{% if tools %}{{ tools | tojson }}{% endif %}"
    out, tools = prepare_conversation(messages, TOOLS, lists_only, HermesToolParser())
    assert tools == TOOLS and "tool_calls" not in out[0]
    assert out[0]["content"] == HermesToolParser().render_call("f", {"a": 1})
    assert isinstance(parser_for_template(template), HermesToolParser)
    llama = "{%- if tools %}<|python_tag|>{{ '\"parameters\": ' }}{% endif %}"
    assert isinstance(parser_for_template(llama), Llama3JsonToolParser)
    assert isinstance(parser_for_template(CHATML), HermesToolParser)


def test_stream_of_a_malformed_call_never_raises() -> None:
    """Mid-stream, text that cannot be a call sends nothing; at the end it is plain content."""
    from loom.entrypoints.openai.serving_chat import _ToolStream

    text = "Sure.\n<tool_call>\nnot json at all\n</tool_call>"
    stream = _ToolStream(HermesToolParser())
    content = ""
    for end in range(1, len(text) + 1):
        delta = stream.delta(text[:end], final=end == len(text))
        assert "tool_calls" not in delta
        content += delta.get("content", "")
    assert content == text and stream.num_calls == 0


# ---- the other formats, against the real templates of their models --------------------------

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
FORMATS = {  # template file -> the parser `auto` must pick for it
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "Qwen3-Coder": "qwen3_coder",
    "Qwen3.5-4B": "qwen3_coder",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "GLM-4.6": "glm45",
    "GLM-4.7-Flash": "glm45",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_v3",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v31",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json",
    "LFM2.5-8B-A1B": "pythonic",
    "LFM2.5-Instruct": "pythonic",  # (lists the tools; writes no calls: Loom's prompt does)
    "ibm-granite-granite-4.0": "hermes",
    "NVIDIA-Nemotron-Nano-v2": "nemotron",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3_coder",
}
TYPED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "opts": {"type": "object"},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
# strings that look like JSON or hold the formats' own characters stay strings
ARGS_1 = {"city": 'Pa"ris <b> [ARGS] {1}', "days": 3, "metric": True, "opts": {"a": [1, 2]},
          "unit": "celsius"}
ARGS_2 = {"tz": "42"}


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize("name", FORMATS)
def test_auto_picks_the_templates_format(name: str) -> None:
    assert parser_for_template(_template(name)).name == FORMATS[name]


@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n] != "llama3_json"])
# (Llama 3.1's template takes one call a turn)
def test_calls_a_real_template_writes_read_back(name: str) -> None:
    """An assistant turn of two calls, rendered by the model's own template (the format it was
    trained on), parses back to the same calls with the same typed arguments; Mistral's
    templates accept the parser's call ids back (they raise on any id but 9 characters)."""
    from transformers.utils.chat_template_utils import (
        _normalize_chat_messages,
        render_jinja_template,
    )

    template = _template(name)
    parser = parser_for_template(template)
    parser.tools = TYPED_TOOLS
    ids = [parser.call_id(), parser.call_id()]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": ids[0], "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(ARGS_1)}},
            {"id": ids[1], "type": "function",
             "function": {"name": "get_time", "arguments": json.dumps(ARGS_2)}}]},
        {"role": "tool", "tool_call_id": ids[0], "content": "TOOL RESULT"},
    ]
    conversation, tools = prepare_conversation(messages, TYPED_TOOLS, template, parser)
    # the templates that list tools get them; R1's does not (a system prompt shows them)
    assert tools == (TYPED_TOOLS if template_supports_tools(template) else None)
    rendered, _ = render_jinja_template(
        conversations=[_normalize_chat_messages(conversation)], tools=tools,
        chat_template=template, add_generation_prompt=False, bos_token="<s>", eos_token="</s>")
    text = rendered[0]
    reply = text[text.index("Weather in Paris?") + 17:text.index("TOOL RESULT")]
    assert calls(parser.view(reply, final=True)) == [("get_weather", ARGS_1),
                                                    ("get_time", ARGS_2)]


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"hermes", "llama3_json"}))
def test_new_formats_stream_and_reject(name: str) -> None:
    """Each format: calls after some content; every prefix's view extends the previous one
    and the last is the final view; broken calls are plain content; text without a call is
    content."""
    parser = PARSERS[name]()
    parser.tools = TYPED_TOOLS
    text = ("Checking.\n" + parser.render_call("get_weather", ARGS_1)
            + ("" if name == "granite" else "\n" + parser.render_call("get_time", ARGS_2)))
    final = parser.view(text, final=True)
    want = [("get_weather", ARGS_1)] + ([] if name == "granite" else [("get_time", ARGS_2)])
    assert final.content == "Checking." and calls(final) == want
    assert_streams_to_the_final_view(parser, text)
    assert parser.view("Sunny, 18 C.", final=True) == ToolCallView("Sunny, 18 C.")
    one = parser.render_call("get_time", ARGS_2)
    for broken in (one[:len(one) * 2 // 3], one.replace("get_time", "")):
        assert parser.view(broken, final=True) == ToolCallView(broken)


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    ids = {MistralToolParser.call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert HermesToolParser.call_id().startswith("call_")


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"hermes", "llama3_json"}))
def test_new_formats_required_grammar(compile_grammar, name: str) -> None:
    """Forced calls in each format: the parser's own rendering of valid calls is accepted
    (one, and several where parallel calls are allowed), invalid ones are not."""
    parser = PARSERS[name]()
    grammar = parser.grammar(TYPED_TOOLS, parallel=True)
    good = parser.render_call("get_weather", ARGS_1)
    assert compile_grammar(grammar, good)
    assert compile_grammar(grammar, parser.render_call("get_weather", {"city": "Oslo"}))
    assert not compile_grammar(grammar, parser.render_call("get_weather", {"days": 2}))
    assert not compile_grammar(grammar, parser.render_call("launch", {"city": "Oslo"}))
    assert not compile_grammar(grammar, parser.render_call("get_weather", {
        "city": "Oslo", "days": "three"}))
    assert not compile_grammar(grammar, parser.render_call("get_weather", {
        "city": "Oslo", "unit": "kelvin"}))
    single = parser.grammar(TYPED_TOOLS[1:], parallel=False)
    assert compile_grammar(single, parser.render_call("get_time", ARGS_2))
    assert not compile_grammar(single, good)


def test_pythonic_bare_list(compile_grammar) -> None:
    """The pythonic format without LFM2's markers (a Llama 3.2 / 4 pythonic template): a reply
    that is one call list is calls, anything else content; the forced grammar is the bare
    list too."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}[func(a=1)]"
    parser = parser_for_template(template, "pythonic")
    parser.tools = TYPED_TOOLS
    assert not parser.marked
    text = parser.render_call("get_weather", ARGS_1)
    assert text.startswith("[get_weather(") and "<|" not in text
    assert calls(parser.view(text, final=True)) == [("get_weather", ARGS_1)]
    both = "[get_weather(city='Oslo', metric=True), get_time(tz=\"UTC\")]"
    assert calls(parser.view(both, final=True)) == [
        ("get_weather", {"city": "Oslo", "metric": True}), ("get_time", {"tz": "UTC"})]
    assert_streams_to_the_final_view(parser, both)
    for content in ("Sunny, 18 C.", "[1, 2, 3]", "[get_weather(city='Oslo')] and more",
                    "[os.system('x')(1)]"):
        assert parser.view(content, final=True) == ToolCallView(content)
    grammar = parser.grammar(TYPED_TOOLS, parallel=True)
    assert compile_grammar(grammar, text)
    assert not compile_grammar(grammar, "<|tool_call_start|>" + text + "<|tool_call_end|>")


def test_pythonic_grammar_places_commas_around_optional_arguments(compile_grammar) -> None:
    """Optional arguments before the first required one, after it, or with none required:
    any of them left out, the rest in the schema's order, one ", " between two."""
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                             "c": {"type": "boolean"}}, "required": ["b"]}}},
        {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"},
                                             "y": {"type": "integer"}}}}},
    ]
    grammar = parser_for_template("{{ messages }}", "pythonic").grammar(tools, parallel=False)
    for good in ("[f(b='x')]", "[f(a=1, b='x')]", "[f(b='x', c=True)]", "[f(a=1, b='x', c=False)]",
                 "[g()]", "[g(y=2)]", "[g(x=1, y=2)]"):
        assert compile_grammar(grammar, good), good
    for bad in ("[f(a=1)]", "[f()]", "[g(, y=2)]", "[f(b='x', )]", "[g(y=2, x=1)]",
                "[f(a=1b='x')]"):
        assert not compile_grammar(grammar, bad), bad
