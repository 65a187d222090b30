"""Tool calls written as a Python list of calls: `[get_weather(city='Paris', days=3), ...]`.

- `pythonic`: the list after `<|tool_call_start|>`, closed by `<|tool_call_end|>` (LFM2 and
  LFM2.5, whose templates write keyword arguments with strings in single quotes, objects as JSON
  and other values as Python writes them); where the chat template has no such markers, the
  reply is the bare list (Llama 3.2 / Llama 4's pythonic format, as vLLM's parser reads it).

Values are read as literals (Python's `ast`: strings in either quote with escapes, numbers,
True / False / None, lists, tuples, dicts; JSON's true / false / null too), never evaluated. A
call shows once its name is known; its arguments JSON once the call is closed.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from loom.tools.calls import (
    ParsedCall,
    SpecialId,
    ToolCallView,
    ToolParser,
    _calls_rule,
    _content_before,
    _Invalid,
    _list_items,
    _lit,
    _name,
    _skip_ws,
    compact,
    tool_params,
)

_LFM2_TOOLS = "List of tools: ["  # how LFM2's templates show the tools
_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
               "None": None}


def _literal(node: ast.AST) -> Any:
    """A literal's value (JSON's names too); _Invalid for anything else."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise _Invalid


def _call(source: str) -> ParsedCall:
    """One whole call's text `name(key=value, ...)` -> the call, arguments as JSON."""
    try:  # (a model's text: deep nesting and NUL bytes are its too)
        node = ast.parse(source.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and not node.args
                and isinstance(node.func, (ast.Name, ast.Attribute))):
            raise _Invalid
        if any(k.arg is None for k in node.keywords):  # **kwargs
            raise _Invalid
        arguments = {k.arg: _literal(k.value) for k in node.keywords}
        name = ast.unparse(node.func)
        return ParsedCall(_name(name), json.dumps(arguments, ensure_ascii=False))
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        raise _Invalid from None


def _scan_list(t: str, i: int, final: bool, calls: list[ParsedCall]) -> int | None:
    """The call list at t[i] == '[' into `calls`; the list's end, or None while it is
    incomplete."""
    return _list_items(t, i, final, lambda j: _take(t, j, final, calls))


def _take(t: str, j: int, final: bool, calls: list[ParsedCall]) -> int | None:
    """The call at t[j] into `calls` once its name is known (its arguments once it closes);
    its end, or None while it is incomplete."""
    paren = t.find("(", j)
    if paren < 0:
        if final or not all(c.isalnum() or c in "_-." for c in t[j:]):
            raise _Invalid
        return None
    name = _name(t[j:paren])
    end = _close(t, paren)
    if end is None:
        if final:
            raise _Invalid
        calls.append(ParsedCall(name, ""))
        return None
    call = _call(t[j:end])
    if call.name != name:
        raise _Invalid
    calls.append(call)
    return end


def _close(t: str, i: int) -> int | None:
    """Past the parenthesis that closes the one at t[i] (strings and brackets skipped), or
    None if it is not there yet."""
    depth, quote, j = 0, "", i
    while j < len(t):
        c = t[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1 if c == ")" else None
        j += 1
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    START, END = "<|tool_call_start|>", "<|tool_call_end|>"  # LFM2's markers
    MARKERS = (START, END)

    def __init__(self, template: str | None = None) -> None:
        super().__init__(template)
        # LFM2's markers where the template writes them or lists tools as LFM2's do (or
        # without a template: Loom's own prompt), the bare list otherwise (Llama 3.2 / 4)
        self.marked = template is None or self.START in template or _LFM2_TOOLS in template

    def _view(self, text: str, final: bool) -> ToolCallView:
        if not self.marked:
            stripped = text.lstrip()
            if not stripped.startswith("["):  # a reply that is not a call list is content
                return ToolCallView(text)
            view = ToolCallView("")
            end = _scan_list(stripped, 0, final, view.calls)
            if final and (end is None or stripped[end:].strip() or not view.calls):
                raise _Invalid
            return view
        view, pos = _content_before(text, self.START, final)
        while pos >= 0 and text.startswith(self.START, pos):
            j = _skip_ws(text, pos + len(self.START))
            if j >= len(text):
                if final:
                    raise _Invalid
                break
            if text[j] != "[":
                raise _Invalid
            end = _scan_list(text, j, final, view.calls)
            if end is None:
                break
            end = _skip_ws(text, end)
            if text.startswith(self.END, end):
                end += len(self.END)
            elif final or not self.END.startswith(text[end:]):
                raise _Invalid
            pos = _skip_ws(text, end)
        if final and not view.calls:
            raise _Invalid
        return view

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        """One list of one call (or several if `parallel`), each `name(key=value, ...)` with
        the required keys and any of the others in the schema's order; strings in single
        quotes (backslash escapes), booleans True / False, other values as JSON (Python reads
        JSON's objects, lists and numbers alike; true / false / null are read too)."""
        start, end = ((_lit(self.START, special) + ' "["', '"]" ' + _lit(self.END, special))
                      if self.marked else ('"["', '"]"'))
        rules, alts = [], []
        for i, name, params in tool_params(tools):
            pairs = []
            for j, key, prop, required in params:
                value = f"v{i}_{j}"
                if prop.get("type") == "string" and "enum" not in prop:
                    rules.append(f"{value}: /'([^'\\\\\\n]|\\\\.)*'/")
                elif prop.get("type") == "boolean":  # as Python writes them (LFM2's template)
                    rules.append(f'{value}: "True" | "False"')
                elif "enum" in prop and all(isinstance(v, str) for v in prop["enum"]):
                    rules.append(f"{value}: " + " | ".join(
                        json.dumps(repr(v)) for v in prop["enum"]))
                else:
                    rules.append(f"{value}: %json {json.dumps(compact(prop))}")
                pairs.append((required, f'"{key}=" {value}'))
            alts.append(f"c{i}")
            rules.append(f"c{i}: {json.dumps(name + '(')} {_pairs(pairs)} \")\"")
        return (_calls_rule(", ", parallel, start, end) + "call: " + " | ".join(alts) + "\n"
                + "\n".join(rules) + "\n")

    def render_call(self, name: str, arguments: Any) -> str:
        args = ", ".join(f"{k}={v!r}" if isinstance(v, (str, bool)) or v is None else
                         f"{k}={json.dumps(v, ensure_ascii=False)}"
                         for k, v in dict(arguments).items())
        text = f"[{name}({args})]"
        return f"{self.START}{text}{self.END}" if self.marked else text


def _pairs(pairs: list[tuple[bool, str]]) -> str:
    """Lark: the pairs (required or not, its rule) in order, joined by ", ", the optional ones
    left out or not: one alternative for each pair that can come first (up to the first
    required one), the pairs after it each behind its ", "; none at all where none is
    required."""
    firsts = []
    for k, (required, pair) in enumerate(pairs):
        rest = " ".join(f'", " {p}' if req else f'(", " {p})?' for req, p in pairs[k + 1:])
        firsts.append(f"({pair} {rest})")
        if required:
            return "(" + " | ".join(firsts) + ")"
    return "(" + " | ".join(firsts) + ")?" if firsts else ""
