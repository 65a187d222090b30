"""JSON-schema rewrites applied before compiling, and the nesting bound on JSON given as text
(no heavy imports: the tool parsers and the request models use them)."""

from __future__ import annotations

import re

# The deepest nesting of arrays and objects accepted in a request: bodies, JSON schemas and tool
# arguments alike (deeper JSON is refused with a 400 before anything recurses into it).
MAX_JSON_DEPTH = 64

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def json_text_depth(text: str) -> int:
    """How deeply arrays and objects nest in `text` (JSON, possibly malformed), found without
    parsing or recursion: brackets inside string literals do not count."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest

_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "additionalItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def no_additional_properties(schema: object) -> object:
    """A copy of `schema` where every object schema that lists `properties` but has no
    `additionalProperties` gets `"additionalProperties": false`."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = no_additional_properties(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [no_additional_properties(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: no_additional_properties(v) for k, v in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
