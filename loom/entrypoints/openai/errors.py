"""OpenAI error envelope `{"error": {message, type, param, code}}` with a fixed status mapping
(the envelope and the mapping: loom.errors, shared with the router).

| status | type                  | when                                                      |
|--------|-----------------------|-----------------------------------------------------------|
| 400    | invalid_request_error | malformed JSON, wrong types, out-of-range or unsupported, |
|        |                       | too deep or too large, a constraint that failed mid-run   |
| 401    | authentication_error  | missing or wrong API key                                  |
| 404    | not_found_error       | unknown route or model name                               |
| 405    | invalid_request_error | wrong HTTP method                                         |
| 413    | invalid_request_error | the body is over --max-request-body-bytes                 |
| 429    | rate_limit_error      | the waiting queue is full (with Retry-After)              |
| 500    | server_error          | a real internal error (that request only)                 |
| 503    | unavailable_error     | shutting down, the engine is not running or recovering    |
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.engine.async_engine import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
)
from loom.errors import error_body
from loom.sampling_params import SamplingParamsError
from loom.tokenizer.tokenizer import ChatTemplateError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client: HTTP status, message, the offending field, a code."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_exception(exc: BaseException) -> APIError:
    """Map an engine or validation exception to the APIError the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, ChatTemplateError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="rate_limit_exceeded",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, (EngineShutdownError, EngineDeadError)):
        return APIError(503, str(exc))
    if isinstance(exc, RequestFailedError):
        return APIError(400 if exc.invalid else 500, str(exc),
                        code="constraint_failed" if exc.invalid else None)
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc))
    if isinstance(exc, RecursionError):  # a structure deeper than a check before caught
        return APIError(400, "the request is nested too deeply")
    logger.error("internal error: %r", exc, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}")


def _loc_to_param(loc: Sequence[int | str]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union branch tags are dropped."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool") or part.startswith(
                ("list", "constrained-", "function-")):
            continue  # pydantic names union members ("list[int]", "str"); not a field
        else:
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: Sequence[Any]) -> APIError:
    """The first pydantic error as a 400 naming the field (malformed JSON has no field)."""
    if not errors:
        return bad_request("invalid request body")
    # Of a union's per-branch errors the deepest names the real problem best.
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    if err.get("type") == "json_invalid":
        reason = err.get("ctx", {}).get("error", "")
        return bad_request(f"malformed JSON body: {reason}".rstrip(": "))
    param = _loc_to_param(err.get("loc", ()))
    if param is None and err.get("type") in ("missing", "model_attributes_type", "dict_type",
                                                   "model_type"):
        return bad_request("the request body must be a JSON object")
    if err.get("type") == "extra_forbidden":
        return bad_request(f"unsupported parameter: {param!r}", param)
    if err.get("type") == "missing":
        return bad_request(f"{param} is required", param)
    message = err.get("msg", "invalid value")
    return bad_request(f"{param}: {message}" if param else message, param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can produce leaves in the OpenAI envelope."""

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message).response()

    async def on_exception(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()

    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_exception)
