"""`loom serve` flags, with vLLM's names where the concept is the same. Imports nothing heavy,
so `loom --help` stays fast."""

from __future__ import annotations

import argparse
import os
from typing import Any

from loom.tools.parsers import PARSERS

DEFAULT_GRACE_SECONDS = 10.0
API_KEY_ENV = "LOOM_API_KEY"


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" unless the help already speaks of its default or X is unset."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `loom serve` on the `loom` subcommand parser."""
    from loom.entrypoints.cli import add_engine_args

    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        formatter_class=_HelpFormatter,
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                    "/version and /metrics (Prometheus). SIGTERM or SIGINT stops accepting "
                    "connections, lets running requests finish within the grace period, "
                    "aborts the rest with an error and exits 0.",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients must send in `model` and that /v1/models lists "
                        "(default: the model argument, or 'smollm2')")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route except /health, "
                        f"/version and /metrics (default: ${API_KEY_ENV} if set, else no key)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *PARSERS],
                   help="how tool calls appear in the model's output; auto: from the chat "
                        "template (hermes when the template knows no tools)")
    p.add_argument("--max-waiting-requests", type=_non_negative_int, default=None,
                   help="answer 429 when this many requests already wait to be scheduled "
                        "(default: no limit)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="do not log each request and its sampling parameters (nor the access log)")
    p.add_argument("--timeout-graceful-shutdown", type=_non_negative_float,
                   default=DEFAULT_GRACE_SECONDS,
                   help="seconds running requests get to finish after SIGTERM/SIGINT before they "
                        "are aborted with an error")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level")
    p.set_defaults(func=_serve)
    return p


def _serve(ns: argparse.Namespace) -> None:
    from loom.entrypoints.openai.api_server import run_server

    if ns.api_key is None:
        ns.api_key = os.environ.get(API_KEY_ENV) or None
    run_server(ns)
