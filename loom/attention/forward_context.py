"""The one forward context: set by the model runner with `with`, read only by attention layers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from loom.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata) -> Iterator[ForwardContext]:
    global _context
    if _context is not None:
        raise RuntimeError("forward context is already set: nested forward passes are not allowed")
    _context = ForwardContext(attn_metadata)
    try:
        yield _context
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention ran outside `set_forward_context`")
    return _context
