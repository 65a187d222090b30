"""Request bodies as the server takes them (body.py), without starting a server: a prompt-like
field is validated as the one form its first item names (a long list of token ids with one bad
item costs one error naming that item); a chunked body is cut off at the size limit."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request

from loom.entrypoints.openai.body import BodySizeLimitMiddleware, parse_body, parse_json_body
from loom.entrypoints.openai.errors import APIError, install_error_handlers
from loom.entrypoints.openai.protocol import CompletionRequest
from loom.entrypoints.openai.serving_embedding import EmbeddingRequest

MODELS = [(CompletionRequest, "prompt"), (EmbeddingRequest, "input")]


@pytest.mark.parametrize(("model", "field"), MODELS)
@pytest.mark.parametrize(("value", "where"), [
    ([1, 2, "x"], "[2]"),  # token ids: the bad item, not "should be a valid string"
    (["a", 3], "[1]"),
    ([[1], [2, "x"]], "[1][1]"),
    ([1] * 100_000 + [None], "[100000]"),
])
def test_the_first_bad_item_is_named(model, field: str, value, where: str) -> None:
    with pytest.raises(APIError) as e:
        parse_json_body(json.dumps({field: value}).encode(), model)
    assert e.value.status == 400
    assert e.value.param == f"{field}{where}", e.value.message


@pytest.mark.parametrize(("model", "field"), MODELS)
@pytest.mark.parametrize("value", ["hi", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_every_form_is_accepted(model, field: str, value) -> None:
    assert getattr(parse_json_body(json.dumps({field: value}).encode(), model), field) == value


def test_a_chunked_body_is_refused_once_it_passes_the_limit() -> None:
    """Without a Content-Length the middleware counts the bytes as they come: 413 in the
    envelope as soon as they pass the limit, and the rest of the body is never read."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, str]:
        return {"prompt": str((await parse_body(request, CompletionRequest)).prompt)}

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=100)
    chunks = [b" " * 60] * 10
    received: list[bytes] = []
    sent: list[dict] = []

    async def receive() -> dict:
        received.append(chunks[len(received)])
        return {"type": "http.request", "body": received[-1],
                "more_body": len(received) < len(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1), "headers": [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    assert len(received) == 2  # 120 bytes read of 600
