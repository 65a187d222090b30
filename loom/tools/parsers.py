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
- `nemotron`: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` (Nemotron Nano 2).
- `deepseek_v3` (DeepSeek V3, R1 and its distills) and `deepseek_v31` (V3.1 and later): calls
  between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` + a ```json fence (v3) or
  `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}` (v31), ending `<｜tool▁call▁end｜>`.
- `qwen3_coder` (Qwen3-Coder, Qwen3.5) and `glm45` (GLM-4.5 to 4.7): XML-like calls whose
  values are text, typed by the tool's schema (loom.tools.xml_parsers).
- `pythonic`: a Python list of keyword calls, `[name(key='value', n=3)]`, between
  `<|tool_call_start|>` and `<|tool_call_end|>` (LFM2, LFM2.5), or bare (Llama 3.2 / 4's
  pythonic templates) (loom.tools.pythonic).

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
from typing import Any

from loom.tools.calls import (
    MAX_PARALLEL_CALLS,
    ParsedCall,
    SpecialId,
    ToolCallView,
    ToolParser,
    _args_object,
    _call_list,
    _call_list_grammar,
    _calls_rule,
    _content_before,
    _Invalid,
    _lit,
    _name,
    _skip_ws,
    _take_call,
    _take_list,
    compact,
    params_schema,
)
from loom.tools.pythonic import _LFM2_TOOLS, PythonicToolParser
from loom.tools.xml_parsers import Glm45ToolParser, Qwen3CoderToolParser

__all__ = ["MAX_PARALLEL_CALLS", "PARSERS", "ParsedCall", "ToolCallView", "ToolParser",
           "parser_for_template"]


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
        # (Small 3.2's template writes name[CALL_ID]id[ARGS]{...})
        name = _name(t[pos:args].split(self.CALL_ID, 1)[0])
        arguments, end = _args_object(t, _skip_ws(t, args + len(self.ARGS)), final)
        calls.append(ParsedCall(name, arguments))
        return end

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        start = _lit(self.START, special)
        if not self.named:
            return _call_list_grammar(start, tools, parallel)
        alts = [f"{start} {json.dumps(t['function']['name'])} {_lit(self.ARGS, special)} "
                f"%json {json.dumps(compact(params_schema(t['function'])))}" for t in tools]
        return _calls_rule("", parallel) + "call: " + " | ".join(alts) + "\n"

    def render_call(self, name: str, arguments: Any) -> str:
        if not self.named:
            return _call_list(self.START, name, arguments)
        return f"{self.START}{name}{self.ARGS}{json.dumps(arguments, ensure_ascii=False)}"


class GraniteToolParser(ToolParser):
    """`<|tool_call|>` and a JSON list of `{"name": ..., "arguments": {...}}` (Granite 3.x)."""

    name = "granite"
    START = "<|tool_call|>"
    MARKERS = (START,)

    def _read(self, t: str, i: int, final: bool, calls: list[ParsedCall]) -> int | None:
        pos = _skip_ws(t, i)
        if pos >= len(t):
            return None
        if t[pos] != "[":
            raise _Invalid
        return _take_list(t, pos, ("arguments",), final, calls)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        return _call_list_grammar(_lit(self.START, special), tools, parallel)

    def render_call(self, name: str, arguments: Any) -> str:
        return _call_list(self.START, name, arguments)


class NemotronToolParser(GraniteToolParser):
    """`<TOOLCALL>`, a JSON list of `{"name": ..., "arguments": {...}}`, `</TOOLCALL>`
    (Nemotron Nano 2)."""

    name = "nemotron"
    START, END = "<TOOLCALL>", "</TOOLCALL>"
    MARKERS = (START, END)

    def _read(self, t: str, i: int, final: bool, calls: list[ParsedCall]) -> int | None:
        end = super()._read(t, i, final, calls)
        if end is None:
            return None
        end = _skip_ws(t, end)
        return end + len(self.END) if t.startswith(self.END, end) else end

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        return _call_list_grammar(_lit(self.START, special), tools, parallel,
                                  _lit(self.END, special))

    def render_call(self, name: str, arguments: Any) -> str:
        return _call_list(self.START, name, arguments, self.END)


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


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, GraniteToolParser,
    NemotronToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser, Qwen3CoderToolParser, Glm45ToolParser,
    PythonicToolParser)}


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
    if NemotronToolParser.START in template:
        return NemotronToolParser
    if PythonicToolParser.START in template or _LFM2_TOOLS in template:  # LFM2's
        return PythonicToolParser
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
