"""Errors shared by modules that must not import each other (sampling_params imports
structured.params, and both raise SamplingParamsError; the server and the router, which answer
in the same OpenAI error envelope)."""

from __future__ import annotations

from typing import Any

# OpenAI's error `type` by HTTP status (when each is answered: loom/entrypoints/openai/errors.py);
# any other status is a server_error from 500 up, else an invalid_request_error.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "unavailable_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope `{"error": {message, type, param, code}}`."""
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
