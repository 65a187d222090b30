"""Errors shared by modules that must not import each other (sampling_params imports
structured.params, and both raise SamplingParamsError)."""

from __future__ import annotations


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
