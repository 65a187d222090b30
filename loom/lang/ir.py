"""The expressions a program adds to its state: text, `gen`, `select` and chat roles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from loom.lang.errors import LangError

# What `s += ...` accepts: text, an expression, or a list/tuple of them (added in order).
Expr = Any


class Seq(tuple):
    """`"text" + gen(...) + "more"`: expressions in order (what `+` between them builds)."""

    def __add__(self, other: Expr) -> Seq:  # type: ignore[override]
        return Seq((*self, other))

    def __radd__(self, other: Expr) -> Seq:
        return Seq((other, *self))


class _Concat:
    def __add__(self, other: Expr) -> Seq:
        return Seq((self, other))

    def __radd__(self, other: Expr) -> Seq:
        return Seq((other, self))


@dataclass(frozen=True)
class GenSpec:
    """How to generate one variable (the backend-neutral subset of SamplingParams).

    At most one constraint: `regex`, `json_schema` or `choices` (exactly one of the strings,
    by constrained decoding; `select` scores them instead).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    regex: str | None = None
    json_schema: dict[str, Any] | None = None
    choices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        constraints = [c for c in (self.regex, self.json_schema, self.choices) if c is not None]
        if len(constraints) > 1:
            raise LangError("gen takes at most one of regex, json_schema and choices")
        if self.choices is not None and not self.choices:
            raise LangError("gen choices must not be empty")

    def structured_outputs(self) -> dict[str, Any] | None:
        """The vLLM-style `structured_outputs` extra for this constraint, or None."""
        if self.regex is not None:
            return {"regex": self.regex}
        if self.json_schema is not None:
            return {"json": self.json_schema}
        if self.choices is not None:
            return {"choice": list(self.choices)}
        return None


@dataclass(frozen=True)
class Gen(_Concat):
    """`gen(name, ...)`: generate text into variable `name`. Unset fields take the run's
    defaults (`run(..., default_gen={...})`), then GenSpec's (greedy, 128 tokens)."""

    name: str | None
    overrides: dict[str, Any] = field(default_factory=dict)

    def spec(self, defaults: dict[str, Any]) -> GenSpec:
        values = {**defaults, **self.overrides}
        for key in ("stop", "choices"):
            if isinstance(values.get(key), str):
                values[key] = (values[key],)
            elif values.get(key) is not None:
                values[key] = tuple(values[key])
        return GenSpec(**values)


@dataclass(frozen=True)
class Select(_Concat):
    """`select(name, choices)`: the choice the model finds most likely after the state, scored
    by the choices' token logprobs (summed, or their mean with method="mean")."""

    name: str | None
    choices: tuple[str, ...]
    method: Literal["sum", "mean"] = "sum"


@dataclass(frozen=True)
class Role(_Concat):
    """A chat message: the role's begin text, the parts, the role's end text."""

    role: str
    parts: tuple[Expr, ...]


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | None = None,
    choices: list[str] | None = None,
) -> Gen:
    """Generate into variable `name` (None: text only). Greedy unless `temperature` > 0."""
    given = {"max_tokens": max_tokens, "stop": stop, "temperature": temperature, "top_p": top_p,
             "top_k": top_k, "seed": seed, "ignore_eos": ignore_eos, "regex": regex,
             "json_schema": json_schema, "choices": choices}
    overrides = {k: v for k, v in given.items() if v is not None}
    Gen(name, overrides).spec({})  # validate now, where the user wrote it
    return Gen(name, overrides)


def select(
    name: str | None = None, choices: list[str] | None = None,
    method: Literal["sum", "mean"] = "sum",
) -> Select:
    """Pick one of `choices` by the model's logprobs of each, in one batched forward."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise LangError("select needs a non-empty list of non-empty strings as choices")
    if method not in ("sum", "mean"):
        raise LangError(f"select method must be 'sum' or 'mean', got {method!r}")
    return Select(name, tuple(choices), method)


def system(*parts: Expr) -> Role:
    return Role("system", parts)


def user(*parts: Expr) -> Role:
    return Role("user", parts)


def assistant(*parts: Expr) -> Role:
    return Role("assistant", parts)
