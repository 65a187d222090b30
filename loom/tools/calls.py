"""What every tool-call format shares: the views a parser gives of a reply (content, then the
calls whose name is known), the JSON scanning that reads a call from a growing text, the base
class and the pieces of the grammars that force calls (loom.tools.parsers, loom.tools.xml_parsers
hold the formats)."""

from __future__ import annotations

import json
import string
import uuid
from collections.abc import Callable, Iterator
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


def _content_before(text: str, tag: str, final: bool) -> tuple[ToolCallView, int]:
    """The view of the text before the first `tag` (the content: all of it if there is no tag,
    less a partial tag while streaming), and where the tag is (-1: nowhere)."""
    first = text.find(tag)
    if first < 0:
        return ToolCallView(text if final else _hold_back(text, tag)), -1
    return ToolCallView(text[:first].rstrip(_WS)), first


def _hold_back(text: str, tag: str) -> str:
    """`text` without a trailing partial `tag` and trailing whitespace (they may start a call)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            text = text[:-k]
            break
    return text.rstrip(_WS)


# A marker's special-token id in the served tokenizer, or None where it is plain text.
SpecialId = Callable[[str], "int | None"]


def _lit(text: str, special: SpecialId | None) -> str:
    """`text` in a Lark grammar: a special token by id (llguidance matches special tokens only
    so), else a string."""
    token = special(text) if special is not None else None
    return f"<[{token}]>" if token is not None else json.dumps(text)


class ToolParser:
    name = ""
    # Marker strings of the format that tokenizers may hold as special tokens
    MARKERS: tuple[str, ...] = ()

    def __init__(self, template: str | None = None) -> None:
        # the request's tools (OpenAI function definitions): the XML formats type values by them
        self.tools: list[dict[str, Any]] | None = None

    @staticmethod
    def call_id() -> str:
        """A new tool call's id."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def view(self, text: str, final: bool) -> ToolCallView:
        """Content and calls in `text`; with `final`, calls that are not all complete and valid
        JSON make the whole text plain content."""
        try:
            return self._view(text, final)
        except ValueError:  # _Invalid, or json.loads on a malformed name or arguments
            if final:
                return ToolCallView(text)
            raise

    START = ""  # the tag before each call, in formats that read calls with `_read`

    def _view(self, text: str, final: bool) -> ToolCallView:
        """Content up to the first START, then calls, each after a START (`_read`)."""
        view, pos = _content_before(text, self.START, final)
        if pos < 0:
            return view
        while text.startswith(self.START, pos):
            end = self._read(text, pos + len(self.START), final, view.calls)
            if end is None:
                break
            pos = _skip_ws(text, end)
        if final and not view.calls:
            raise _Invalid
        return view

    def _read(self, t: str, i: int, final: bool, calls: list[ParsedCall]) -> int | None:
        """The call after a START (t[i] just past it) into `calls` once its name is known;
        its end, or None while it is incomplete (raises _Invalid where it cannot be one)."""
        raise NotImplementedError

    # How one call is written: {"name": ..., ARGS_KEY: {...}} inside CALL_RULE (a Lark rule
    # around `body`), calls joined by SEPARATOR.
    ARGS_KEY = "arguments"
    CALL_RULE = "body"
    SEPARATOR = "\n"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        """A Lark grammar (llguidance) whose sentences are one call (or several if `parallel`)
        of the given functions, each valid against its parameter schema, in this format;
        `special`: the served tokenizer's ids of the format's markers."""
        body = json.dumps(call_schema(tools, self.ARGS_KEY))
        return (f"{_calls_rule(self.SEPARATOR, parallel)}call: {self.CALL_RULE}\n"
                f"body: %json {body}\n")

    def render_call(self, name: str, arguments: Any) -> str:
        """One call as the model writes it (for templates that cannot render tool calls)."""
        return json.dumps({"name": name, self.ARGS_KEY: arguments}, ensure_ascii=False)


def _calls_rule(separator: str, parallel: bool, start: str = "", end: str = "") -> str:
    """`start: ...` of one call, or of up to MAX_PARALLEL_CALLS joined by `separator`, between
    `start` and `end` (grammar text)."""
    more = f" ({json.dumps(separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    return f"start: {start} call{more} {end}\n"


def _call_list_grammar(start: str, tools: list[dict[str, Any]], parallel: bool,
                       end: str = "") -> str:
    """Lark: `start` (grammar text) and a JSON list of one call object (up to
    MAX_PARALLEL_CALLS if `parallel`), then `end` (grammar text, if any): Granite's, Mistral's
    older form and Nemotron's."""
    items = compact({"type": "array", "items": call_schema(tools, "arguments"), "minItems": 1,
                     "maxItems": MAX_PARALLEL_CALLS if parallel else 1})
    return f"start: {start} %json {json.dumps(items)} {end}\n"


def _call_list(start: str, name: str, arguments: Any, end: str = "") -> str:
    """One call written as `start`, a JSON list and `end` (_call_list_grammar's form)."""
    return (start + json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)
            + end)


def tool_params(tools: list[dict[str, Any]]
                ) -> Iterator[tuple[int, str, list[tuple[int, str, dict[str, Any], bool]]]]:
    """For forced-call grammars: (index, name, [(index, key, schema, required)]) a function,
    its parameters in its schema's order."""
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = params_schema(fn)
        required = set(schema.get("required") or ())
        yield i, fn["name"], [(j, key, prop, key in required) for j, (key, prop) in
                              enumerate((schema.get("properties") or {}).items())]


def params_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema, closed to other properties."""
    return no_additional_properties(fn.get("parameters") or {"type": "object", "properties": {}})


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` for a grammar's %json, written as json.dumps writes it (no free whitespace: a
    weak model under a grammar would otherwise fill it with blanks)."""
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}}


def _take_list(t: str, i: int, args_keys: tuple[str, ...], final: bool,
               calls: list[ParsedCall]) -> int | None:
    """The JSON list of call objects at t[i] == '[' into `calls`; its end, or None while it
    is incomplete (an incomplete final list is invalid)."""
    return _list_items(t, i, final, lambda j: _take_call(t, j, args_keys, final, calls))


def _list_items(t: str, i: int, final: bool, take: Callable[[int], int | None]) -> int | None:
    """The comma-separated list at t[i] == '[', each item read by `take(j)` (its end, or None
    while it is incomplete); the list's end, or None while it is incomplete (an incomplete
    final list is invalid)."""
    j = _skip_ws(t, i + 1)
    while j < len(t):
        if t[j] == "]":
            return j + 1
        end = take(j)
        if end is None:
            return None
        j = _skip_ws(t, end)
        if j < len(t) and t[j] == ",":
            j = _skip_ws(t, j + 1)
        elif j < len(t) and t[j] != "]":
            raise _Invalid
    if final:
        raise _Invalid
    return None


def _args_object(t: str, start: int, final: bool) -> tuple[str, int | None]:
    """The arguments object at t[start] (or where it will start): its text so far and its
    end (None while incomplete; an incomplete or non-object final one is invalid)."""
    if start >= len(t):
        if final:
            raise _Invalid
        return "", None
    if t[start] != "{":
        raise _Invalid
    end = _scan_value(t, start)
    if end is None:
        if final:
            raise _Invalid
        return t[start:], None
    if not isinstance(json.loads(t[start:end]), dict):
        raise _Invalid
    return t[start:end], end


_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")


def _name(text: str) -> str:
    """A function name written between markers (OpenAI's names: letters, digits, _ - .)."""
    name = text.strip()
    if not name or not set(name) <= _NAME_CHARS:
        raise _Invalid
    return name


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """JSON schema of one call object: {"name": const, args_key: that function's parameters}."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = params_schema(fn)
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False,
        })
    return compact(options[0] if len(options) == 1 else {"anyOf": options})
