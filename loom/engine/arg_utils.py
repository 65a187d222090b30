"""Command-line flags generated from frozen dataclasses (`EngineArgs`, the server's `ServerArgs`).

A field declared with `flag(...)` becomes `--field-name`: its default, help, choices and --help
section live in the one declaration, and `from_namespace` builds the dataclass back from the
parsed flags, so an option is one line. The flag's type comes from the annotation (int, float,
str; `X | None` is X); a bool defaulting to False is a switch (`--x`), one defaulting to True
takes `--x/--no-x`. Imports nothing heavy: every `loom` command builds these parsers.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# --help sections, in the order `loom serve --help` shows them (vLLM's grouping).
MODEL = "model"
CACHE = "cache"
SCHEDULER = "scheduler"
KERNELS = "quantization and kernels"
SERVER = "server"
GROUP_ORDER = (MODEL, CACHE, SCHEDULER, KERNELS, SERVER)
# --log-level of the HTTP commands (`loom serve`, `loom router`): uvicorn's names.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

_NO_CLI_DEFAULT = object()


def flag(
    default: Any,
    help: str,  # noqa: A002 - argparse's name
    group: str,
    *,
    choices: Sequence[Any] | None = None,
    type: Callable[[str], Any] | None = None,  # noqa: A002
    cli_default: Any = _NO_CLI_DEFAULT,
) -> Any:
    """A dataclass field that is also a command-line flag. `cli_default` is the command line's
    default where it differs from the Python API's (e.g. `loom serve`'s step budget)."""
    meta = {"help": help, "group": group, "choices": choices, "type": type,
            "cli_default": cli_default}
    return dataclasses.field(default=default, metadata=meta)


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" unless the help already speaks of its default or X is unset."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def cli_default(f: dataclasses.Field) -> Any:
    """The command line's default of a `flag(...)` field."""
    meta = f.metadata
    return f.default if meta["cli_default"] is _NO_CLI_DEFAULT else meta["cli_default"]


def flags_set(cls: type, ns: argparse.Namespace, skip: Iterable[str] = (),
              defaults: dict[str, Any] | None = None) -> list[str]:
    """The `--flag` names of `cls` whose parsed value is not their default (`defaults`: those a
    command's parser changed with set_defaults): what the user set."""
    skip, defaults = set(skip), defaults or {}
    return ["--" + f.name.replace("_", "-") for f in flag_fields(cls)
            if f.name not in skip and hasattr(ns, f.name)
            and getattr(ns, f.name) != defaults.get(f.name, cli_default(f))]


def _flag_type(annotation: Any) -> Any:
    """int | None -> int; str -> str."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"a flag needs one type, got {annotation}")
        return args[0]
    return annotation


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def flag_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    positional: Iterable[str] = (),
    skip: Iterable[str] = (),
) -> None:
    """Add a flag for each `flag(...)` field of `cls` to its --help section of `parser`.
    Fields named in `positional` are an optional positional argument instead."""
    hints = typing.get_type_hints(cls)
    positional, skip = set(positional), set(skip)
    titles = {f.metadata["group"] for f in flag_fields(cls) if f.name not in skip}
    order = {title: i for i, title in enumerate(GROUP_ORDER)}
    for title in sorted(titles, key=lambda t: (order.get(t, len(order)), t)):
        _group(parser, title)  # sections in GROUP_ORDER, whatever the fields' order
    for f in flag_fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        default = cli_default(f)
        kwargs: dict[str, Any] = {"default": default, "help": meta["help"]}
        kind = _flag_type(hints[f.name])
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kwargs["type"] = meta["type"] or kind
            if meta["choices"] is not None:
                kwargs["choices"] = list(meta["choices"])
        if f.name in positional:
            _group(parser, "positional arguments").add_argument(f.name, nargs="?", **kwargs)
        else:
            name = "--" + f.name.replace("_", "-")
            _group(parser, meta["group"]).add_argument(name, dest=f.name, **kwargs)


def from_namespace(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """The `cls` the parsed flags describe; fields without a flag keep their defaults."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return cls(**{**values, **overrides})


def _number(kind: type, low: float, inclusive: bool) -> Callable[[str], Any]:
    word = "at least" if inclusive else "greater than"
    noun = "an integer" if kind is int else "a number"

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not (value >= low if inclusive else value > low):
            raise argparse.ArgumentTypeError(f"must be {word} {low:g}, got {text}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


positive_int = _number(int, 1, inclusive=True)
non_negative_int = _number(int, 0, inclusive=True)
positive_float = _number(float, 0, inclusive=False)
non_negative_float = _number(float, 0, inclusive=True)
