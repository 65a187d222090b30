"""Tool calls written as XML-like text, each argument's value as text:

- `qwen3_coder` (Qwen3-Coder, Qwen3.5):
  `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>`
- `glm45` (GLM-4.5 to 4.7):
  `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...</tool_call>`

A value is typed by the request's tool schema, as the templates write them (strings as they
are, anything else as JSON; Qwen3-Coder's template writes booleans as Python's True / False):
a parameter of type string stays text, an integer, number, boolean, object, array or null is
read as JSON (text that is not stays a string), a parameter the schema does not type stays
text. A call's `arguments` is the JSON object of its values, built in the order written, so
while streaming it only grows: a string value as its characters come (a partial closing tag
held back), any other value once closed, the `}` with the call's closing tag.
"""

from __future__ import annotations

import json
from typing import Any

from loom.tools.calls import (
    ParsedCall,
    SpecialId,
    ToolParser,
    _calls_rule,
    _hold_back,
    _Invalid,
    _name,
    _skip_ws,
    compact,
    tool_params,
)

_NOT_TEXT = frozenset({"integer", "number", "boolean", "object", "array", "null"})
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"), (type(None), "null"))


def _types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a parameter schema allows (from `type`, else its enum's or const's)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return {next(n for t, n in _JSON_TYPES if isinstance(v, t)) for v in values}


def _is_text(schema: dict[str, Any] | None) -> bool:
    """A value the template writes as it is: a string, or a parameter the schema does not type."""
    kinds = _types(schema or {})
    return "string" in kinds or not kinds & _NOT_TEXT


def _typed(schema: dict[str, Any] | None, raw: str) -> Any:
    """A parameter's text as the value its schema types it to (see the module docstring)."""
    if _is_text(schema):
        return raw
    text = raw.strip()
    if "boolean" in _types(schema or {}) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return raw


def _arguments(items: list[tuple[str, str]], partial: tuple[str, str] | None,
               closed: bool) -> str:
    """The arguments' JSON text: whole (key, JSON value) items, then a string value still
    being written, then `}` once the call is closed."""
    parts = [f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in items]
    if partial is not None:
        key, text = partial
        parts.append(f"{json.dumps(key, ensure_ascii=False)}: "
                     f"{json.dumps(text, ensure_ascii=False)[:-1]}")
    return "{" + ", ".join(parts) + ("}" if closed else "")


class XmlToolParser(ToolParser):
    """The two formats' shared reading: calls between START and END, each a name and KEY / VALUE
    pairs; a format says where they are (`_head`, `_pair`)."""

    START, END = "<tool_call>", "</tool_call>"
    KEY, KEY_END = "", ""  # a pair's opening (up to its key) and the key's closing
    VALUE_END = ""  # a value's closing tag
    VALUE_CLOSE = ""  # what the grammar writes after a value (the template's closing)
    SEPARATOR = "\n"  # between calls

    def _schema(self, name: str) -> dict[str, Any]:
        """The parameter schemas of the request's function `name` ({} if unknown)."""
        for tool in self.tools or ():
            fn = tool.get("function", {})
            if fn.get("name") == name:
                return (fn.get("parameters") or {}).get("properties") or {}
        return {}

    def _head(self, t: str, pos: int, final: bool) -> tuple[str, int] | None:
        """The call's name and where its pairs start; None while the name is incomplete."""
        raise NotImplementedError

    def _close(self, t: str, pos: int) -> int | None:
        """Past the call's closing tags at t[pos] (None if they are not there)."""
        raise NotImplementedError

    def _value_start(self, t: str, pos: int) -> int | None:
        """Where the value starts, t[pos] being just past the key's closing (None while the
        tags between are incomplete)."""
        raise NotImplementedError

    def _read(self, t: str, pos: int, final: bool, calls: list[ParsedCall]) -> int | None:
        head = self._head(t, pos, final)
        if head is None:
            if final:
                raise _Invalid
            return None
        name, j = head
        schemas = self._schema(name)
        items: list[tuple[str, str]] = []
        while True:
            j = _skip_ws(t, j)
            closed = self._close(t, j)
            if closed is not None:
                calls.append(ParsedCall(name, _arguments(items, None, True)))
                return closed
            if not t.startswith(self.KEY, j):
                if final or not self._may_continue(t[j:]):
                    raise _Invalid
                break
            key_end = t.find(self.KEY_END, j + len(self.KEY))
            if key_end < 0:
                break
            key = t[j + len(self.KEY):key_end].strip()
            start = self._value_start(t, key_end + len(self.KEY_END))
            if start is None:
                break
            end = t.find(self.VALUE_END, start)
            if end < 0:  # the value is still coming: a string's shows
                if final:
                    raise _Invalid
                partial = (key, self._partial(t[start:])) if _is_text(schemas.get(key)) else None
                calls.append(ParsedCall(name, _arguments(items, partial, False)))
                return None
            raw = self._raw(t[start:end])
            items.append((key, json.dumps(_typed(schemas.get(key), raw), ensure_ascii=False)))
            j = end + len(self.VALUE_END)
        if final:
            raise _Invalid
        calls.append(ParsedCall(name, _arguments(items, None, False)))
        return None

    def _may_continue(self, rest: str) -> bool:
        """`rest` (the text past the last pair) may still become a pair or the closing."""
        raise NotImplementedError

    def _raw(self, value: str) -> str:
        """A whole value's text as written between its tags."""
        return value

    def _partial(self, value: str) -> str:
        """A value's text so far, without what may be the start of its closing tag."""
        return _hold_back(value, self.VALUE_END)

    def _pair(self, key: str, value: str) -> str:
        """Lark: a pair's opening up to its value, then `value` (a rule ending in VALUE_END)."""
        raise NotImplementedError

    def _call_rule(self, name: str, pairs: str) -> str:
        raise NotImplementedError

    def _pairs(self, arguments: Any, opening: str) -> str:
        """A call's pairs as the templates write them (`opening`: between a key's closing
        and its value)."""
        return "".join(
            f"{self.KEY}{k}{self.KEY_END}{opening}"
            f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            f"{self.VALUE_CLOSE}\n" for k, v in dict(arguments).items())

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                special: SpecialId | None = None) -> str:
        rules, alts = [], []
        close = json.dumps(self.VALUE_CLOSE)
        # a string value: the shortest text that ends in its closing (lazy)
        text_rule = "/(?s:.*)" + close[1:-1].replace("/", "\\/") + "/"
        for i, name, params in tool_params(tools):
            pairs = []
            for j, key, prop, required in params:
                value = f"v{i}_{j}"
                if not _is_text(prop):
                    rules.append(f"{value}: %json {json.dumps(compact(prop))} {close}")
                elif "enum" in prop and all(isinstance(v, str) for v in prop["enum"]):
                    words = " | ".join(json.dumps(v) for v in prop["enum"])
                    rules.append(f"{value}: ({words}) {close}")
                else:
                    rules.append(f"{value}[lazy]: {text_rule}")
                pair = self._pair(key, value)
                pairs.append(pair if required else f"({pair})?")
            alts.append(f"c{i}")
            rules.append(f"c{i}: {self._call_rule(name, ' '.join(pairs))}")
        return (_calls_rule(self.SEPARATOR, parallel) + "call: " + " | ".join(alts) + "\n"
                + "\n".join(rules) + "\n")


class Qwen3CoderToolParser(XmlToolParser):
    name = "qwen3_coder"
    FN, FN_END = "<function=", "</function>"
    KEY, KEY_END, VALUE_END = "<parameter=", ">", "</parameter>"
    VALUE_CLOSE = "\n</parameter>"

    def _head(self, t: str, pos: int, final: bool) -> tuple[str, int] | None:
        pos = _skip_ws(t, pos)
        if not t.startswith(self.FN, pos):
            if final or not self.FN.startswith(t[pos:]):
                raise _Invalid
            return None
        close = t.find(">", pos + len(self.FN))
        if close < 0:
            return None
        return _name(t[pos + len(self.FN):close]), close + 1

    def _close(self, t: str, pos: int) -> int | None:
        if not t.startswith(self.FN_END, pos):
            return None
        j = _skip_ws(t, pos + len(self.FN_END))
        return j + len(self.END) if t.startswith(self.END, j) else j

    def _may_continue(self, rest: str) -> bool:
        return any(tag.startswith(rest) for tag in (self.KEY, self.FN_END))

    def _value_start(self, t: str, pos: int) -> int | None:
        if pos >= len(t):
            return None
        return pos + 1 if t[pos] == "\n" else pos  # the template's newline after the tag

    def _raw(self, value: str) -> str:  # the template's newline before the closing tag
        return value[:-1] if value.endswith("\n") else value

    def _pair(self, key: str, value: str) -> str:
        return f"{json.dumps(self.KEY + key + self.KEY_END + chr(10))} {value} \"\\n\""

    def _call_rule(self, name: str, pairs: str) -> str:
        return (f"{json.dumps(self.START + chr(10) + self.FN + name + '>' + chr(10))} {pairs} "
                f"{json.dumps(self.FN_END + chr(10) + self.END)}")

    def render_call(self, name: str, arguments: Any) -> str:
        pairs = self._pairs(arguments, "\n")
        return f"{self.START}\n{self.FN}{name}>\n{pairs}{self.FN_END}\n{self.END}"


class Glm45ToolParser(XmlToolParser):
    name = "glm45"
    KEY, KEY_END, VALUE_END = "<arg_key>", "</arg_key>", "</arg_value>"
    VALUE_CLOSE = VALUE_END
    VALUE = "<arg_value>"

    def _head(self, t: str, pos: int, final: bool) -> tuple[str, int] | None:
        ends = [i for i in (t.find("\n", pos), t.find("<", pos)) if i >= 0]
        if not ends:
            return None
        return _name(t[pos:min(ends)]), min(ends)

    def _close(self, t: str, pos: int) -> int | None:
        return pos + len(self.END) if t.startswith(self.END, pos) else None

    def _may_continue(self, rest: str) -> bool:
        return any(tag.startswith(rest) for tag in (self.KEY, self.END))

    def _value_start(self, t: str, pos: int) -> int | None:
        j = _skip_ws(t, pos)
        if t.startswith(self.VALUE, j):
            return j + len(self.VALUE)
        if self.VALUE.startswith(t[j:]):
            return None
        raise _Invalid

    def _pair(self, key: str, value: str) -> str:
        opening = f"{self.KEY}{key}{self.KEY_END}\n{self.VALUE}"
        return f"{json.dumps(opening)} {value} \"\\n\""

    def _call_rule(self, name: str, pairs: str) -> str:
        return f"{json.dumps(self.START + name + chr(10))} {pairs} {json.dumps(self.END)}"

    def render_call(self, name: str, arguments: Any) -> str:
        return f"{self.START}{name}\n{self._pairs(arguments, chr(10) + self.VALUE)}{self.END}"
