"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of a
list of choices, or a grammar (Lark, or llama.cpp's GBNF). Exactly one per request."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from loom.errors import SamplingParamsError
from loom.structured.schema import MAX_JSON_DEPTH, json_text_depth

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_SERVER_ONLY = {"thinking"}


@dataclass
class StructuredOutputsParams:
    """Field names follow vLLM's `StructuredOutputsParams`.

    json: a JSON schema (dict or JSON text). json_object: any JSON object. regex: a regular
    expression the whole output matches (Rust `regex` syntax). choice: the output is exactly one
    of these strings. grammar: a Lark grammar, or a GBNF grammar as llama.cpp writes them.
    any_whitespace: JSON may contain free whitespace between tokens; by default Loom emits one
    line with ", " and ": " separators, so a weak model cannot loop on whitespace.
    additional_properties: an object schema that lists `properties` but says nothing about
    `additionalProperties` allows extra keys (JSON Schema's rule). Off by default: Loom then
    emits only the listed keys, as OpenAI's `strict` mode requires, still a valid instance,
    and a weak model cannot wander off into invented keys.
    """

    json: dict[str, Any] | str | None = None  # JSON text is parsed
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = False
    additional_properties: bool = False
    # A thinking model's reply constrained from its first token, its thinking block included
    # (vLLM's `enable_in_reasoning`, here per request); by default the constraint holds from
    # the answer on (`thinking`).
    enable_in_reasoning: bool = False
    # Set by the server, not by clients: a thinking model's reply holds its `<think>` block
    # before the constrained answer: "open" (the prompt opened the block: free text up to
    # `</think>` comes first) or "optional" (such a block may come first).
    thinking: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            if json_text_depth(self.json) > MAX_JSON_DEPTH:
                raise SamplingParamsError(
                    "structured_outputs", f"json nests deeper than {MAX_JSON_DEPTH} levels")
            try:
                self.json = json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise SamplingParamsError("structured_outputs", f"json is not valid JSON: {e}")
        if self.json is not None and not isinstance(self.json, dict):
            raise SamplingParamsError("structured_outputs",
                                      f"json must be a JSON schema object, got {self.json!r}")
        kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                f"exactly one of {', '.join(_KINDS)} must be set, got {kinds or 'none'}",
            )
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise SamplingParamsError("structured_outputs",
                                          "choice must be a non-empty list of non-empty strings")
        if self.thinking not in (None, "open", "optional"):
            raise SamplingParamsError("structured_outputs",
                                      f"thinking must be 'open' or 'optional', not {self.thinking!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError("structured_outputs", f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A stable cache key: equal keys compile to the same grammar."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps(values, sort_keys=True, separators=(",", ":"))

    @classmethod
    def coerce(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise SamplingParamsError("structured_outputs",
                                      "must be a StructuredOutputsParams or a dict of its fields")
        # (fields the server sets are no client's to give)
        unknown = (set(value) - {f.name for f in fields(cls)}) | (set(value) & _SERVER_ONLY)
        if unknown:
            raise SamplingParamsError("structured_outputs",
                                      f"unknown structured_outputs field(s): {sorted(unknown)}")
        return cls(**value)
