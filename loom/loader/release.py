"""Drop the pages of a GGUF file's memory map that no loaded tensor reads any more.

Loom maps the file and reads each tensor from the map: K-quant blocks stay there (the kernels
read them as stored), but the tensors converted at load (32-wide blocks onto Loom's int8 grid,
float norms copied into parameters) are read once. Their pages stay mapped and resident after
that, counted in the server's RSS (Gemma 3 270M: ~190 MB of its 241 MB file). After the load,
`release_unused` tells the kernel to drop every page of the map's tensor data outside the
storage of the tensors the model still holds (madvise MADV_DONTNEED: on a private file map the
pages come back from the file if ever touched again, so nothing can go wrong but a page fault).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from loom.heap import madvise as _madvise
from loom.loader import hugepages

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels answer EINVAL and fault on first use


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor | np.ndarray]:
    """Every tensor `obj` holds: in attributes, dicts, lists, tuples, dataclasses (KBlocks)."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        yield obj
    elif depth > 4 or isinstance(obj, (str, bytes, int, float, type)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
        yield from _tensors(vars(obj), depth + 1)


def held_ranges(model: nn.Module) -> list[tuple[int, int]]:
    """(start, end) addresses of the storage of every tensor the model's modules hold."""
    ranges = set()
    for module in model.modules():
        for name, value in vars(module).items():
            if name == "_modules":
                continue
            for t in _tensors(value):
                if isinstance(t, np.ndarray):
                    if t.nbytes:  # a view's whole span, strides included
                        lo, hi = np.lib.array_utils.byte_bounds(t)
                        ranges.add((lo, hi))
                    continue
                if t.device.type != "cpu" or t.is_meta:
                    continue
                storage = t.untyped_storage()
                if storage.nbytes():
                    ranges.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted(ranges)


def _free_spans(start: int, end: int, held: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """[start, end) less the `held` ranges (sorted by start)."""
    cursor = start
    for a, b in held:
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            yield cursor, a
        cursor = max(cursor, b)
    if cursor < end:
        yield cursor, end


def _held_spans(start: int, end: int, held: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """[start, end) intersected with the `held` ranges (sorted by start)."""
    for a, b in held:
        if b > start and a < end:
            yield max(a, start), min(b, end)


def _advise(lo: int, hi: int, advice: int) -> int:
    """madvise(`advice`) the pages [lo, hi) (page-aligned); returns the bytes advised, 0 where
    it failed (the pages stay as they were: only memory or a first read's faults are lost)."""
    madvise = _madvise()
    if madvise is None or hi <= lo:
        return 0
    if madvise(lo, hi - lo, advice) != 0:
        logger.debug("madvise(%#x, %d, %d) failed: %s", lo, hi - lo, advice,
                     os.strerror(ctypes.get_errno()))
        return 0
    return hi - lo


def drop_pages(start: int, end: int) -> int:
    """madvise(MADV_DONTNEED) the whole pages inside [start, end) of a private file map;
    returns the bytes dropped."""
    page = mmap.PAGESIZE
    return _advise(-(-start // page) * page, end // page * page, _MADV_DONTNEED)


def populate_pages(start: int, end: int) -> int:
    """madvise(MADV_POPULATE_READ) the pages spanning [start, end) of a file map: read from the
    file where not cached, and mapped, as a first read would; returns the bytes populated."""
    page = mmap.PAGESIZE
    return _advise(start // page * page, -(-end // page) * page, _MADV_POPULATE_READ)


def release_unused(reader: Any, model: nn.Module) -> int:
    """madvise(MADV_DONTNEED) the pages of `reader`'s tensor data that `model` no longer reads,
    and map in the ones it reads (MADV_POPULATE_READ: the first request does not fault them in
    one by one, SmolLM2-1.7B's Q4_K_M: ~0.25 s of CPU); returns the bytes released (0 off
    Linux)."""
    if _madvise() is None or not reader.tensors:
        return 0
    held = held_ranges(model)
    released = populated = 0
    for t in reader.tensors:
        start = t.data.ctypes.data
        for a, b in _free_spans(start, start + t.data.nbytes, held):
            released += drop_pages(a, b)
        for a, b in _held_spans(start, start + t.data.nbytes, held):
            populated += populate_pages(a, b)
    logger.debug("released %.1f MiB of the GGUF map's pages, mapped in %.1f MiB", released / 2**20,
                 populated / 2**20)
    return released


def map_spans(reader: Any) -> list[tuple[int, int]]:
    """(start, end) addresses of each tensor's data in `reader`'s file map."""
    return [(t.data.ctypes.data, t.data.ctypes.data + t.data.nbytes) for t in reader.tensors]


def huge_pager(model: nn.Module, reader: Any = None) -> hugepages.HugePager | None:
    """What puts `model`'s weights on huge pages while the engine is idle (hugepages.py): the
    spans of `reader`'s file map it reads, and the storage of its own tensors. None where the
    machine has no transparent huge pages. Called after release_unused, which drops the file's
    other pages: the moved spans are anonymous memory after, which no MADV_DONTNEED may touch."""
    if not hugepages.enabled():
        return None
    held = held_ranges(model)
    spans = map_spans(reader) if reader is not None else []
    kept = ([s for a, b in spans for s in _held_spans(a, b, held)]
            if hugepages.copies_allowed() else [])
    lo = min((a for a, _ in spans), default=0)
    hi = max((b for _, b in spans), default=0)
    own = [(a, b) for a, b in held if b <= lo or a >= hi]
    return hugepages.HugePager(kept, own)
