"""Request bodies: a size limit (413), then JSON parsing, the Unicode and nesting checks and the
pydantic validation, on a worker thread unless the body is small (offload.py), so a large body
never stalls the event loop (and with it /health and every running stream).

Routes take the raw `Request` and call `parse_body(request, Model)`; `openapi_body(Model)` keeps
the body's schema in the OpenAPI document (`install_openapi` adds the models' schemas to it).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loom.entrypoints.openai.errors import APIError, bad_request, validation_error
from loom.entrypoints.openai.offload import INLINE_BODY_BYTES, run_sized
from loom.structured.schema import MAX_JSON_DEPTH

M = TypeVar("M", bound=BaseModel)


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, or as soon as the bytes
    received pass it (a chunked body is never buffered past the limit)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._too_large()(scope, receive, send)

    def _too_large(self) -> Any:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes "
                             "(--max-request-body-bytes)", code="request_too_large").response()


class _TooLarge(Exception):
    pass


async def parse_body(request: Request, model: type[M]) -> M:
    """The validated body of `request` as `model`, parsed and checked off the event loop
    (on it when the body is small: INLINE_BODY_BYTES).

    Every failure is an APIError: 400 for malformed JSON, strings that are not valid Unicode
    (lone surrogates), nesting deeper than MAX_JSON_DEPTH, or a field pydantic rejects."""
    raw = await request.body()
    return await run_sized(len(raw), INLINE_BODY_BYTES, parse_json_body, raw, model)


def parse_json_body(raw: bytes, model: type[M]) -> M:
    """What `parse_body` does, synchronously."""
    if not raw.strip():
        raise bad_request("the request body must be a JSON object")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


def check_json(data: Any) -> None:
    """400 for a string (or key) that is not valid Unicode, or nesting deeper than
    MAX_JSON_DEPTH; the message names where. Iterative: no recursion on hostile input."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise bad_request(f"{path or 'the body'} nests deeper than {MAX_JSON_DEPTH} "
                                  "levels", path or None)
            if isinstance(value, dict):
                for key, item in value.items():
                    sub = f"{path}.{key}" if path else str(key)
                    _check_text(key, sub)
                    stack.append((item, sub, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{path} is not valid Unicode: it holds a lone surrogate "
                          "(\\ud800-\\udfff not in a pair)", path or None) from None


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that parses `model` itself: its request body schema."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add `models` (and what they reference) to the app's OpenAPI components."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
