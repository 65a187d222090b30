"""Placeholder until the OpenAI-compatible server lands (issue: `loom serve`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    from loom.entrypoints.cli import add_engine_args

    add_engine_args(p)
    p.set_defaults(func=_serve)


def _serve(ns: argparse.Namespace) -> None:
    raise SystemExit("loom serve is not implemented yet")
