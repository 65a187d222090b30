"""`loom router --backend URL ...`: the cache-aware router in front of `loom serve` replicas
(loom/router). Imports nothing heavy until it runs."""

from __future__ import annotations

import argparse
from typing import Any

from loom.engine.arg_utils import HelpFormatter, add_dataclass_args, from_namespace
from loom.router.args import RouterArgs


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "router", help="route OpenAI requests over several `loom serve` replicas",
        formatter_class=HelpFormatter,
        description="An OpenAI-compatible proxy over independent `loom serve` replicas: each "
                    "request goes to the replica likely to hold its prompt's prefix in cache, "
                    "balanced against load; replicas are health-checked and a request whose "
                    "replica fails before streaming anything is retried on another. Serves "
                    "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                    "/detokenize, /health and its own /metrics.",
    )
    p.add_argument("--backend", dest="backends", action="append", required=True,
                   metavar="URL", help="a replica's base URL (http://host:port); repeat for each")
    add_dataclass_args(p, RouterArgs)
    p.set_defaults(func=_route)
    return p


def _route(ns: argparse.Namespace) -> None:
    from loom.router.app import run_router

    run_router(from_namespace(RouterArgs, ns, backends=tuple(ns.backends)))
