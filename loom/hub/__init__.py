"""Models by name: aliases, `org/repo[:QUANT]`, pulled into and resolved from the HF cache."""

from loom.hub.cache import describe, list_models, remove, resolve_cached
from loom.hub.pull import ChecksumError, PullError, pull
from loom.hub.registry import ALIASES, ModelNameError, ModelRef, parse_name

__all__ = ["ALIASES", "ChecksumError", "ModelNameError", "ModelRef", "PullError", "describe",
           "list_models", "parse_name", "pull", "remove", "resolve_cached"]
