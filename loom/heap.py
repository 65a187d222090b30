"""Give the C heap's free memory back to the system (glibc's `malloc_trim`).

Parsing a big tokenizer.json (Gemma 3's 262k-token vocabulary) or converting weights leaves
hundreds of MB freed inside the heap: glibc keeps it, so the process's RSS stays up though
nothing uses it (Gemma 3's tokenizer: 306 MiB resident after loading, 113 MiB after a trim).
Start-up trims after each such phase. A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():  # -> the C function, or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


def trim() -> bool:
    """Return the heap's free pages to the system; True where something was released."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
