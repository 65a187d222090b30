"""`loom pull | list | rm | show`: the model commands (Ollama's verbs)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

MODEL_HELP = ("a model name: an alias (smollm2, qwen3:0.6b, gemma3:270m, ...), org/repo for a "
              "safetensors or GGUF repo, or org/repo:QUANT for one GGUF file (e.g. :Q8_0)")


def add_hub_parsers(sub: Any) -> None:
    """Register the four subcommands on the `loom` subcommand parser."""
    p = sub.add_parser("pull", help="download a model by name into the Hugging Face cache",
                       description="Download a model into the Hugging Face cache (resumes a "
                                   "broken transfer, checks every file's checksum). HF_ENDPOINT "
                                   "selects a mirror, HF_TOKEN a token; HF_HOME the cache.")
    p.add_argument("name", help=MODEL_HELP)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("list", help="list the models available offline")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("rm", help="delete a downloaded model from the cache")
    p.add_argument("names", nargs="+", metavar="name", help=MODEL_HELP)
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("show", help="where a downloaded model is and what it is")
    p.add_argument("name", help=MODEL_HELP)
    p.set_defaults(func=cmd_show)


def cmd_pull(ns: argparse.Namespace) -> None:
    from loom.hub import ModelNameError, PullError, pull

    try:
        pull(ns.name, progress=not ns.quiet)
    except (ModelNameError, PullError) as e:
        raise SystemExit(f"error: {e}") from None


def cmd_list(ns: argparse.Namespace) -> None:
    from loom.hub.cache import age, list_models

    rows = [("NAME", "ALIAS", "FORMAT", "SIZE", "MODIFIED")]
    for m in list_models():
        rows.append((m.name, m.alias or "-", m.kind, f"{m.size / 1e6:.1f} MB", age(m.modified)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_rm(ns: argparse.Namespace) -> None:
    from loom.hub import ModelNameError, remove
    from loom.loader.resolve import ModelNotFoundError

    failed = False
    for name in ns.names:
        try:
            remove(name)
            print(f"deleted {name}")
        except (ModelNameError, ModelNotFoundError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    if failed:
        raise SystemExit(1)


def cmd_show(ns: argparse.Namespace) -> None:
    from loom.config import ConfigError
    from loom.hub import describe
    from loom.loader.resolve import ModelNotFoundError

    try:
        info = describe(ns.name)
    except (ModelNotFoundError, ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key.ljust(width)}  {value}")


def main(argv: list[str] | None = None) -> None:
    """`python -m loom.hub.cli` (the same commands without the rest of `loom`)."""
    parser = argparse.ArgumentParser(prog="loom")
    add_hub_parsers(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    ns.func(ns)


if __name__ == "__main__":
    main()
