"""`loom serve`: the engine's flags (`EngineArgs`) and the server's (`ServerArgs`), both generated
from their dataclasses (loom.engine.arg_utils). Imports nothing heavy, so `loom --help` stays
fast."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

from loom.engine.arg_utils import HelpFormatter, add_dataclass_args, from_namespace
from loom.engine.args import EngineArgs
from loom.entrypoints.openai.server_args import API_KEY_ENV, ServerArgs


def register(sub: Any) -> argparse.ArgumentParser:
    """Register `loom serve` on the `loom` subcommand parser."""
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        formatter_class=HelpFormatter,
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                    "/v1/chat/completions, /v1/responses, /v1/messages (Anthropic's), "
                    "/v1/embeddings, /v1/models, /tokenize, /detokenize, /health, "
                    "/version and /metrics (Prometheus); a chat page at / and a live engine "
                    "view at /dashboard. SIGTERM or SIGINT stops accepting "
                    "connections, lets running requests finish within the grace period, "
                    "aborts the rest with an error and exits 0.",
    )
    add_dataclass_args(p, EngineArgs, positional=("model",))
    add_dataclass_args(p, ServerArgs)
    p.set_defaults(func=_serve)
    return p


def _serve(ns: argparse.Namespace) -> None:
    _readahead(ns.model)  # before the imports below (torch): the disk reads while they run
    from loom.entrypoints.openai.api_server import run_server

    server_args = from_namespace(ServerArgs, ns)
    if server_args.api_key is None:
        server_args = replace(server_args, api_key=os.environ.get(API_KEY_ENV) or None)
    if server_args.data_parallel_size > 1:
        from loom.entrypoints.openai.data_parallel import run_data_parallel

        run_data_parallel(from_namespace(EngineArgs, ns), server_args)
        return
    run_server(from_namespace(EngineArgs, ns), server_args)


def _readahead(model: str | None) -> None:
    """Start reading the model's files into the page cache (loom.loader.pagein)."""
    from loom.loader.pagein import readahead
    from loom.loader.resolve import ModelNotFoundError, resolve_model

    try:
        readahead(resolve_model(model).path)
    except (ModelNotFoundError, OSError):
        pass  # the engine reports it with its own message
