"""Tool calls in a model's own output format -> OpenAI `tool_calls`, whole or while streaming.

Formats:
- `hermes`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call,
  any text before the first block is the message content (Qwen2.5/Qwen3, Hermes, SmolLM2 and
  Loom's own fallback prompt for templates that know no tools).
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` (calls separated by
  `;`, optionally after `<|python_tag|>`), as Llama 3.1/3.2 emit them.

One function, `ToolParser.view(text, final)`, serves both answers: streaming diffs the views of
the growing text, and the non-streamed answer is the final view, so streamed deltas always
reassemble to the non-streamed result. A call's `arguments` is the model's own JSON text of the
arguments object (validated when final).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loom.structured.schema import no_additional_properties

_WS = " \t\r\n"
# With parallel calls allowed, a forced ("required") reply holds at most this many calls, so a
# weak model that keeps calling cannot run into max_tokens and cut its last call in half.
MAX_PARALLEL_CALLS = 4


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text; a prefix of it while streaming


@dataclass
class ToolCallView:
    """What can be shown of `text` so far: content, then the calls whose name is known."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class _Invalid(ValueError):
    """Text that cannot be a tool call in this format (a ValueError, as callers expect)."""


def _skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def _scan_string(t: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at t[i] == '"', None if incomplete."""
    j = i + 1
    while j < len(t):
        if t[j] == "\\":
            j += 2
            continue
        if t[j] == '"':
            return j + 1
        j += 1
    return None


def _scan_value(t: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at t[i], None if the text ends inside it."""
    c = t[i]
    if c == '"':
        return _scan_string(t, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(t):
            ch = t[j]
            if ch == '"':
                end = _scan_string(t, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # number, true, false, null: ends at a delimiter (unknown at the end of the text)
    while j < len(t) and t[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(t) else None


def _scan_object(t: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Top-level members of the object at t[i] == '{': key -> (value start, end or None), and
    the object's end (None if incomplete). Raises _Invalid on text that is not JSON."""
    members: dict[str, tuple[int, int | None]] = {}
    j = _skip_ws(t, i + 1)
    if j < len(t) and t[j] == "}":
        return members, j + 1
    while True:
        if j >= len(t):
            return members, None
        if t[j] != '"':
            raise _Invalid
        key_end = _scan_string(t, j)
        if key_end is None:
            return members, None
        key = json.loads(t[j:key_end])
        j = _skip_ws(t, key_end)
        if j >= len(t):
            return members, None
        if t[j] != ":":
            raise _Invalid
        j = _skip_ws(t, j + 1)
        if j >= len(t):
            return members, None
        end = _scan_value(t, j)
        members[key] = (j, end)
        if end is None:
            return members, None
        j = _skip_ws(t, end)
        if j >= len(t):
            return members, None
        if t[j] == ",":
            j = _skip_ws(t, j + 1)
        elif t[j] == "}":
            return members, j + 1
        else:
            raise _Invalid


def _call_from(t: str, members: dict[str, tuple[int, int | None]], args_keys: tuple[str, ...],
               final: bool) -> ParsedCall | None:
    """The call described by an object's members; None while its name is still unknown."""
    name_span = members.get("name")
    if name_span is None or name_span[1] is None:
        if final:
            raise _Invalid
        return None
    name = json.loads(t[name_span[0]:name_span[1]])
    if not isinstance(name, str) or not name:
        raise _Invalid
    span = next((members[k] for k in args_keys if k in members), None)
    if span is None:
        return ParsedCall(name, "{}" if final else "")
    start, end = span
    arguments = t[start:end] if end is not None else t[start:]
    if final:
        if end is None or not isinstance(json.loads(arguments), dict):
            raise _Invalid
    return ParsedCall(name, arguments)


def _take_call(t: str, start: int, args_keys: tuple[str, ...], final: bool,
               calls: list[ParsedCall]) -> int | None:
    """Append the call object at t[start] to `calls` (once its name is known); return the
    object's end, or None while it is incomplete (an incomplete final call is invalid)."""
    if t[start] != "{":
        raise _Invalid
    members, end = _scan_object(t, start)
    call = _call_from(t, members, args_keys, final and end is not None)
    if call is not None:
        calls.append(call)
    if end is None and final:
        raise _Invalid
    return end


def _hold_back(text: str, tag: str) -> str:
    """`text` without a trailing partial `tag` and trailing whitespace (they may start a call)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            text = text[:-k]
            break
    return text.rstrip(_WS)


class ToolParser:
    name = ""

    def view(self, text: str, final: bool) -> ToolCallView:
        """Content and calls in `text`; with `final`, calls that are not all complete and valid
        JSON make the whole text plain content."""
        try:
            return self._view(text, final)
        except ValueError:  # _Invalid, or json.loads on a malformed name or arguments
            if final:
                return ToolCallView(text)
            raise

    def _view(self, text: str, final: bool) -> ToolCallView:
        raise NotImplementedError

    # How one call is written: {"name": ..., ARGS_KEY: {...}} inside CALL_RULE (a Lark rule
    # around `body`), calls joined by SEPARATOR.
    ARGS_KEY = "arguments"
    CALL_RULE = "body"
    SEPARATOR = "\n"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) whose sentences are one call (or several if `parallel`)
        of the given functions, each valid against its parameter schema, in this format."""
        body = json.dumps(call_schema(tools, self.ARGS_KEY))
        more = f"({json.dumps(self.SEPARATOR)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel \
            else ""
        return f"start: call {more}\ncall: {self.CALL_RULE}\nbody: %json {body}\n"

    def render_call(self, name: str, arguments: Any) -> str:
        """One call as the model writes it (for templates that cannot render tool calls)."""
        return json.dumps({"name": name, self.ARGS_KEY: arguments}, ensure_ascii=False)


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """JSON schema of one call object: {"name": const, args_key: that function's parameters}."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = no_additional_properties(fn.get("parameters") or {"type": "object",
                                                                     "properties": {}})
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}
    return schema


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def _view(self, text: str, final: bool) -> ToolCallView:
        first = text.find(self.START)
        if first < 0:
            return ToolCallView(text if final else _hold_back(text, self.START))
        view = ToolCallView(text[:first].rstrip(_WS))
        pos = first
        while text.startswith(self.START, pos):
            start = _skip_ws(text, pos + len(self.START))
            if start >= len(text):
                break
            end = _take_call(text, start, ("arguments", "parameters"), final, view.calls)
            if end is None:
                break
            pos = _skip_ws(text, end)
            if text.startswith(self.END, pos):
                pos = _skip_ws(text, pos + len(self.END))
        if final and not view.calls:
            raise _Invalid
        return view

    CALL_RULE = '"<tool_call>\\n" body "\\n</tool_call>"'

    def render_call(self, name: str, arguments: Any) -> str:
        return f"{self.START}\n{super().render_call(name, arguments)}\n{self.END}"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def _view(self, text: str, final: bool) -> ToolCallView:
        body = text[len(self.PYTHON_TAG):] if text.startswith(self.PYTHON_TAG) else text
        pos = _skip_ws(body, 0)
        if pos >= len(body):
            return ToolCallView(text if final else "")
        if body[pos] != "{":
            if final or not self.PYTHON_TAG.startswith(body[pos:]):
                return ToolCallView(text)
            return ToolCallView("")
        view = ToolCallView("")
        while pos < len(body):
            end = _take_call(body, pos, ("parameters", "arguments"), final, view.calls)
            if end is None:
                break
            pos = _skip_ws(body, end)
            if pos < len(body) and body[pos] == ";":
                pos = _skip_ws(body, pos + 1)
            elif pos < len(body):
                raise _Invalid
        return view

    ARGS_KEY = "parameters"
    SEPARATOR = "; "


PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser, Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def parser_for_template(template: str | None, choice: str = "auto") -> ToolParser:
    """The parser named `choice`, or for "auto" the format the chat template uses (Hermes when
    the template shows none: Loom then renders the tools in Hermes format itself)."""
    if choice != "auto":
        return PARSERS[choice]()
    if template and "<tool_call>" not in template and (
        "<|python_tag|>" in template or '"parameters"' in template
    ):
        return Llama3JsonToolParser()
    return HermesToolParser()
