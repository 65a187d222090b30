"""JSON-schema rewrites applied before compiling (no heavy imports: the tool parsers use them)."""

from __future__ import annotations

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
