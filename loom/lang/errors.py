"""Errors and warnings of loom.lang."""

from __future__ import annotations


class LangError(RuntimeError):
    """A program cannot run as written (bad expression, missing template, backend refusal)."""


class LangFallbackWarning(UserWarning):
    """A backend cannot do something exactly (e.g. `select` by logprobs) and does less."""
