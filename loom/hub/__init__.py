"""Models by name: aliases and `org/repo[:QUANT]`, pulled into and resolved from the local
Hugging Face cache. Below the loader: imports huggingface_hub, never the rest of Loom."""

from loom.hub.cache import (
    ModelNotPulledError, list_models, packaged_gguf, remove, resolve_cached,
)
from loom.hub.pull import ChecksumError, PullError, pull
from loom.hub.registry import ALIASES, ModelNameError, ModelRef, parse_name

__all__ = ["ALIASES", "ChecksumError", "ModelNameError", "ModelNotPulledError", "ModelRef",
           "PullError", "list_models", "packaged_gguf", "parse_name", "pull", "remove",
           "resolve_cached"]
