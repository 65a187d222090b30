"""Tools and tool messages into the chat template.

A template that knows tools (it reads the `tools` variable, as Qwen2.5/Qwen3, Llama 3.1 and
Hermes templates do) gets the OpenAI tools and messages as they are, with each call's arguments
as a dict (the Hugging Face convention). A template that does not (SmolLM2's, plain ChatML) gets
what Qwen2.5's template would have written: the tools in the system message, past calls as
`<tool_call>` blocks, tool results as `<tool_response>` blocks in a user turn. Where the parser
is of another format (a template that writes its calls but lists no tools, as DeepSeek-R1's),
the system message shows that format and past calls are written in it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.tools.parsers import ToolParser

_TOOLS_HEADER = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

"""
_TOOLS_PROMPT = _TOOLS_HEADER + """For each function call, return a json object with function \
name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
# The same for a parser of another format (a template that writes that format's calls but
# does not list the tools, as DeepSeek-R1's): its own rendering of a call as the example.
_FORMAT_PROMPT = _TOOLS_HEADER + """To call a function, reply with the call in this format:
{example}"""


def tools_prompt(tools: list[dict[str, Any]], parser: ToolParser) -> str:
    """The system prompt's tools section for a template that does not render them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if parser.name == "hermes":
        return _TOOLS_PROMPT.format(tools=listed)
    example = parser.render_call("<function-name>", {"<argument-name>": "<value>"})
    return _FORMAT_PROMPT.format(tools=listed, example=example)


def _with_calls(content: str | None, calls: list[dict[str, Any]], parser: ToolParser) -> str:
    """An assistant's content followed by its calls as the model writes them."""
    rendered = "\n".join(parser.render_call(c["function"]["name"],
                                            _arguments(c["function"]["arguments"]))
                         for c in calls)
    return f"{content}\n{rendered}" if content else rendered


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def prepare_conversation(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str | None,
    parser: ToolParser,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand to the chat template; see the module docstring."""
    native = template_supports_tools(template)
    # a template that lists tools but never writes an assistant's calls (LFM2.5 Instruct's)
    # would drop them from the conversation: they go into the content, in the model's format
    writes_calls = native and "tool_calls" in (template or "")
    out: list[dict[str, Any]] = []
    if tools and not native:
        prompt = tools_prompt(tools, parser)
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0])
            first["content"] = f"{first['content']}\n\n{prompt}"
            messages = [first, *messages[1:]]
        else:
            out.append({"role": "system", "content": prompt})
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if native and (writes_calls or not calls):
            if calls:
                m["tool_calls"] = [
                    {**c, "function": {**c["function"],
                                       "arguments": _arguments(c["function"]["arguments"])}}
                    for c in calls
                ]
            out.append(m)
            continue
        if native:  # its calls as text; the rest as the template writes it
            m["content"] = _with_calls(m.get("content"), calls, parser)
            out.append(m)
            continue
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
            continue
        if calls:
            m["content"] = _with_calls(m.get("content"), calls, parser)
        if m.get("content") is None:
            m["content"] = ""
        m.pop("tool_call_id", None)
        out.append(m)
    for m in out:
        m.pop("_tool_turn", None)
    return out, (tools if native else None)
