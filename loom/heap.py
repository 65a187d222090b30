"""Give memory back to the system through the C library: the heap's free pages (glibc's
`malloc_trim`) and a file map's pages (`madvise`, loom.loader.release).

Parsing a big tokenizer.json (Gemma 3's 262k-token vocabulary) or converting weights leaves
hundreds of MB freed inside the heap: glibc keeps it, so the process's RSS stays up though
nothing uses it (Gemma 3's tokenizer: 306 MiB resident after loading, 113 MiB after a trim).
Start-up trims after each such phase. A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library the process runs on (its symbols as loaded, errno kept), or None off
    Linux."""
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@functools.cache
def madvise():  # -> libc's madvise(address, length, advice) -> 0 or -1 (errno), or None
    fn = getattr(libc(), "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def trim() -> bool:
    """Return the heap's free pages to the system; True where something was released."""
    fn = getattr(libc(), "malloc_trim", None)  # musl and others have none
    return bool(fn(0)) if fn is not None else False


def meminfo() -> dict[str, int]:
    """/proc/meminfo's fields given in kB, in bytes (MemAvailable, MemTotal, ...); empty where
    the system has none."""
    try:
        with open("/proc/meminfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name] = int(parts[0]) << 10
    return fields


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor whose host pages are committed only as they are first written: on the
    host from calloc (past glibc's mmap threshold, at most 32 MiB, a fresh mapping, zero
    untouched; a smaller one may come from the heap, zeroed and committed at once), where
    torch.zeros would write every page; torch.zeros on a device. (torch is imported here, on
    use: this module loads before it.)"""
    import numpy as np
    import torch

    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
