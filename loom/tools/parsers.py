"""Tool calls in a model's own output format -> OpenAI `tool_calls`, whole or while streaming.

Formats:
- `hermes`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call,
  any text before the first block is the message content (Qwen2.5/Qwen3, Hermes, SmolLM2 and
  Loom's own fallback prompt for templates that know no tools).
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` (calls separated by
  `;`, optionally after `<|python_tag|>`), as Llama 3.1/3.2 emit them.
- `mistral`: `[TOOL_CALLS]name[ARGS]{...}` a call (Mistral Small 3.2, Magistral, Devstral), or
  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo).
- `granite`: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (Granite 3.x).
- `deepseek_v3` (DeepSeek V3, R1 and its distills) and `deepseek_v31` (V3.1 and later): calls
  between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` + a ```json fence (v3) or
  `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}` (v31), ending `<｜tool▁call▁end｜>`.
- `qwen3_coder` (Qwen3-Coder, Qwen3.5) and `glm45` (GLM-4.5 to 4.7): XML-like calls whose
  values are text, typed by the tool's schema (loom.tools.xml_parsers).

Markers that tokenizers hold as special tokens (`[TOOL_CALLS]`, `<|tool_call|>`, ...) would be
dropped from the text by skip_special_tokens: the server keeps them for requests with tools (as
vLLM does for Mistral), and forced-call grammars name them by token id.

One function, `ToolParser.view(text, final)`, serves both answers: streaming diffs the views of
the growing text, and the non-streamed answer is the final view, so streamed deltas always
reassemble to the non-streamed result. A call's `arguments` is the model's own JSON text of the
arguments object (validated when final).
"""

from __future__ import annotations

import json
import random
import string
import uuid
from collections.abc import Callable
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
    j = _skip_ws(t, i + 1)
    while j < len(t):
        if t[j] == "]":
            return j + 1
        end = _take_call(t, j, args_keys, final, calls)
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


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def _read(self, t: str, i: int, final: bool, calls: list[ParsedCall]) -> int | None:
        start = _skip_ws(t, i)
        if start >= len(t):
            return None
        end = _take_call(t, start, ("arguments", "parameters"), final, calls)
        if end is None:
            return None
        end = _skip_ws(t, end)
        return end + len(self.END) if t.startswith(self.END, end) else end

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


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]name[ARGS]{...}` a call (`name[CALL_ID]id[ARGS]` too), or
    `[TOOL_CALLS][{...}, ...]` (both are read; the template says which one the model writes,
    for grammars). Ids: 9 letters and digits, the only ids Mistral's templates accept back."""

    name = "mistral"
    START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    MARKERS = (START, ARGS, CALL_ID)

    def __init__(self, template: str | None = None) -> None:
        super().__init__(template)
        self.named = template is None or self.ARGS in template or self.START not in template

    @staticmethod
    def call_id() -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def _read(self, t: str, i: int, final: bool, calls: list[ParsedCall]) -> int | None:
        pos = _skip_ws(t, i)
        if pos < len(t) and t[pos] == "[":
            return _take_list(t, pos, ("arguments",), final, calls)
        return self._named_call(t, pos, final, calls)

    def _named_call(self, t: str, pos: int, final: bool, calls: list[ParsedCall]) -> int | None:
        args = t.find(self.ARGS, pos)
        if args < 0:  # the name is still coming
            if final:
                raise _Invalid
            return None
        name = t[pos:args]  # (Small 3.2's template writes name[CALL_ID]id[ARGS]{...})
        name = _name(name[:name.find(self.CALL_ID)] if self.CALL_ID in name else name)
        arguments, end = _args_object(t, _skip_ws(t, args + len(self.ARGS)), final)
        calls.append(ParsedCall(name, arguments))
        return end

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        start = _lit(self.START, special)
        if not self.named:
            items = compact({"type": "array", "items": call_schema(tools, "arguments"),
                             "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1})
            return f"start: {start} %json {json.dumps(items)}\n"
        alts = [f"{start} {json.dumps(t['function']['name'])} {_lit(self.ARGS, special)} "
                f"%json {json.dumps(compact(params_schema(t['function'])))}" for t in tools]
        return _calls_rule("", parallel) + "call: " + " | ".join(alts) + "\n"

    def render_call(self, name: str, arguments: Any) -> str:
        if not self.named:
            return self.START + json.dumps([{"name": name, "arguments": arguments}],
                                           ensure_ascii=False)
        return f"{self.START}{name}{self.ARGS}{json.dumps(arguments, ensure_ascii=False)}"


class GraniteToolParser(ToolParser):
    """`<|tool_call|>` and a JSON list of `{"name": ..., "arguments": {...}}` (Granite 3.x)."""

    name = "granite"
    START = "<|tool_call|>"
    MARKERS = (START,)

    def _view(self, text: str, final: bool) -> ToolCallView:
        view, first = _content_before(text, self.START, final)
        if first < 0:
            return view
        pos = _skip_ws(text, first + len(self.START))
        if pos < len(text):
            if text[pos] != "[":
                raise _Invalid
            _take_list(text, pos, ("arguments",), final, view.calls)
        if final and not view.calls:
            raise _Invalid
        return view

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        items = compact({"type": "array", "items": call_schema(tools, "arguments"),
                         "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1})
        return f"start: {_lit(self.START, special)} %json {json.dumps(items)}\n"

    def render_call(self, name: str, arguments: Any) -> str:
        return self.START + json.dumps([{"name": name, "arguments": arguments}],
                                       ensure_ascii=False)


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek V3 / R1: `<｜tool▁calls▁begin｜>` then calls
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>`
    (a newline between them), then `<｜tool▁calls▁end｜>`; further blocks right after it are
    read too (R1's template writes one a call)."""

    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    MARKERS = (BEGIN, END, CALL, SEP, CALL_END)
    FENCE, FENCE_END = "```json", "```"
    FENCED = True  # v3: the type, the name on its line, the arguments in a ```json fence

    def _view(self, text: str, final: bool) -> ToolCallView:
        view, first = _content_before(text, self.BEGIN, final)
        if first < 0:
            return view
        pos = first + len(self.BEGIN)
        while True:
            pos = _skip_ws(text, pos)
            rest = text[pos:]
            if rest.startswith(self.END):  # R1's template writes each call in its own block
                after = _skip_ws(text, pos + len(self.END))
                if not text.startswith(self.BEGIN, after):
                    break
                pos = after + len(self.BEGIN)
                continue
            if not rest:  # (a final reply may lack the end marker)
                break
            if not rest.startswith(self.CALL):
                if not final and (self.CALL.startswith(rest) or self.END.startswith(rest)):
                    break
                raise _Invalid
            pos = self._call(text, pos + len(self.CALL), final, view.calls)
            if pos is None:
                break
        if final and not view.calls:
            raise _Invalid
        return view

    def _call(self, t: str, pos: int, final: bool, calls: list[ParsedCall]) -> int | None:
        sep = t.find(self.SEP, pos)
        if sep < 0:
            if final:
                raise _Invalid
            return None
        j = sep + len(self.SEP)
        if self.FENCED:
            line = t.find("\n", j)
            if line < 0:  # the name's line is still coming
                if final:
                    raise _Invalid
                return None
            name, j = _name(t[j:line]), _skip_ws(t, line)
            if t.startswith(self.FENCE, j):
                j = _skip_ws(t, j + len(self.FENCE))
            elif self.FENCE.startswith(t[j:]) and not final:
                calls.append(ParsedCall(name, ""))
                return None
        else:
            name = _name(t[pos:sep])
        arguments, end = _args_object(t, _skip_ws(t, j), final)
        calls.append(ParsedCall(name, arguments))
        if end is None:
            return None
        j = _skip_ws(t, end)
        if self.FENCED and t.startswith(self.FENCE_END, j):
            j = _skip_ws(t, j + len(self.FENCE_END))
        if t.startswith(self.CALL_END, j):
            return j + len(self.CALL_END)
        if final and j >= len(t):  # a whole reply that ends without its closing markers
            return j
        closing = (self.FENCE_END + self.CALL_END, self.CALL_END) if self.FENCED else (
            self.CALL_END,)
        if final or not any(c.startswith(t[j:]) for c in closing):
            raise _Invalid
        return None  # the call's closing markers are still coming

    def _one(self, name: str, args: str, special: SpecialId | None) -> str:
        """One call of the grammar (args: its arguments' grammar)."""
        call, sep, end = (_lit(m, special) for m in (self.CALL, self.SEP, self.CALL_END))
        if self.FENCED:
            return (f'{call} "function" {sep} {json.dumps(name + chr(10) + self.FENCE + chr(10))}'
                    f' {args} {json.dumps(chr(10) + self.FENCE_END)} {end}')
        return f"{call} {json.dumps(name)} {sep} {args} {end}"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        alts = [self._one(t["function"]["name"],
                          f"%json {json.dumps(compact(params_schema(t['function'])))}", special)
                for t in tools]
        return (_calls_rule("\n" if self.FENCED else "", parallel, _lit(self.BEGIN, special),
                            _lit(self.END, special)) + "call: " + " | ".join(alts) + "\n")

    def render_call(self, name: str, arguments: Any) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        if self.FENCED:
            body = f"function{self.SEP}{name}\n{self.FENCE}\n{args}\n{self.FENCE_END}"
        else:
            body = f"{name}{self.SEP}{args}"
        return f"{self.BEGIN}{self.CALL}{body}{self.CALL_END}{self.END}"


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek V3.1 and later: `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

    name = "deepseek_v31"
    FENCED = False


# The XML-like formats build on the classes above.
from loom.tools.xml_parsers import Glm45ToolParser, Qwen3CoderToolParser  # noqa: E402

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, GraniteToolParser,
    DeepSeekV3ToolParser, DeepSeekV31ToolParser, Qwen3CoderToolParser, Glm45ToolParser)}


def _detect(template: str) -> type[ToolParser]:
    """The format a chat template writes its assistant's tool calls in."""
    if "<function=" in template:  # Qwen3-Coder's XML inside <tool_call>
        return Qwen3CoderToolParser
    if "<arg_key>" in template:
        return Glm45ToolParser
    if DeepSeekV3ToolParser.BEGIN in template:
        return DeepSeekV3ToolParser if "```json" in template else DeepSeekV31ToolParser
    if MistralToolParser.START in template:
        return MistralToolParser
    if GraniteToolParser.START in template:
        return GraniteToolParser
    if "<tool_call>" not in template and (
            "<|python_tag|>" in template or '"parameters"' in template):
        return Llama3JsonToolParser
    return HermesToolParser


def parser_for_template(template: str | None, choice: str = "auto") -> ToolParser:
    """The parser named `choice`, or for "auto" the format the chat template uses (Hermes when
    the template shows none: Loom then renders the tools in Hermes format itself)."""
    if choice != "auto":
        return PARSERS[choice](template)
    return (_detect(template) if template else HermesToolParser)(template)
