"""The `loom` command line. Each subcommand lives in its own module with a
`register(subparsers)` that adds its parser and sets `func`; add a module to SUBCOMMANDS to add a
`loom <subcommand>`. Registering imports nothing heavy: `loom --help` stays fast."""

from __future__ import annotations

import argparse
import logging

from loom.bench import cli as bench
from loom.entrypoints import chat, generate, hub_cli, router_cli
from loom.entrypoints.openai import cli_args as serve
from loom.threads import apply_thread_defaults

SUBCOMMANDS = (serve, generate, bench, hub_cli, chat, router_cli)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    # The process is Loom's: the thread defaults go in before the command imports torch
    # (registering imports nothing heavy; tests/unit/test_threads.py holds it to that).
    apply_thread_defaults()
    ns.func(ns)


if __name__ == "__main__":
    main()
