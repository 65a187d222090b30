"""Hold the weights on 2 MiB pages (Linux transparent huge pages), while the server is idle.

A decode step reads every weight once: on 4 KiB pages that is a TLB entry per 4 KiB, and the
page walks show in a step that streams gigabytes (2026-12-05, 2-core Zen 4 VM, one stream:
0.97x the decode step of Llama-3-8B's shape in Q4_K_M, 0.96x SmolLM2-1.7B's, 0.90x Gemma 3
270M's; the 135M's, whose weights stay in the caches, unchanged; docs/startup_memory.md).

Two kinds of memory hold weights after a load:
- tensors the loader built (converted blocks): anonymous memory, which `madvise(MADV_HUGEPAGE)`
  marks and `MADV_COLLAPSE` (Linux 6.1+) moves onto huge pages in place;
- blocks the kernels read as stored in the GGUF file's private map (K-quants): the file's pages,
  which the kernel maps 4 KiB at a time (MADV_COLLAPSE refuses a private file map). Those are
  copied, CHUNK at a time, into anonymous memory on huge pages that `mremap` then puts at the
  same addresses, so every view of the map reads the same bytes, now through 2 MiB pages.

Neither is done during the load: a huge page costs the kernel a compaction where free memory is
fragmented (on this VM 0.45-8 GB/s by the machine's state), which would make the start-up of a
large model seconds longer. The server's engine thread does it a piece at a time while it has no
request (`HugePager.step`). A copy is anonymous memory: unlike the file's pages the kernel cannot
drop it under pressure and read it back, so it is made only where the machine has room for it
(`_room_for`), and not by data-parallel replicas, which share the file's pages
(`LOOM_HUGE_PAGES=tensors`: the loader's tensors only). `LOOM_HUGE_PAGES=0` turns it off; where
the kernel's transparent huge pages are `never`, nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

from loom.heap import libc, meminfo

logger = logging.getLogger(__name__)

HUGE = 2 << 20
CHUNK = 64 << 20  # copied and remapped at a time: the copy's extra memory meanwhile
ENV = "LOOM_HUGE_PAGES"
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MAP_FIXED = 1, 2, 0x10  # Linux
_MAP_FAILED = ctypes.c_void_p(-1).value
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def copies_allowed() -> bool:
    """Whether file spans may be copied (LOOM_HUGE_PAGES is not `tensors`)."""
    return os.environ.get(ENV, "1") != "tensors"


def enabled() -> bool:
    """Linux with transparent huge pages not `never`, and not turned off by LOOM_HUGE_PAGES=0."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV, "1") == "0":
        return False
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


class _Calls:
    """The C library's mmap, munmap, mremap, madvise and mincore with their types (`_calls()`:
    None where it has no mremap, off glibc)."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        self.mmap = libc.mmap
        self.mmap.restype, self.mmap.argtypes = vp, [vp, size, ctypes.c_int, ctypes.c_int,
                                                     ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.argtypes = [vp, size]
        self.mremap = libc.mremap
        self.mremap.restype, self.mremap.argtypes = vp, [vp, size, size, ctypes.c_int, vp]
        self.madvise = libc.madvise
        self.madvise.argtypes = [vp, size, ctypes.c_int]
        self.mincore = libc.mincore
        self.mincore.argtypes = [vp, size, ctypes.POINTER(ctypes.c_ubyte)]


@functools.cache  # (one set of argtypes on the shared CDLL's functions)
def _calls() -> _Calls | None:
    lib = libc()
    return _Calls(lib) if lib is not None and hasattr(lib, "mremap") else None


def _interior(lo: int, hi: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside [lo, hi)."""
    return -(-lo // HUGE) * HUGE, hi // HUGE * HUGE


class HugePager:
    """Puts a loaded model's weights on huge pages a piece at a time, for a caller with
    nothing else to do (module docstring). `step` does one piece (PIECE bytes: a request that
    arrives meanwhile waits for it, ~1-10 ms) and says whether it did anything; once all is
    done, or the machine has no room for the copies, it does nothing.

    file_spans: [lo, hi) of a private file map the model reads (moved whole pages at a time);
    anon: [lo, hi) of the model's own tensors (collapsed in place)."""

    PIECE = 4 << 20

    def __init__(self, file_spans: list[tuple[int, int]], anon: list[tuple[int, int]]) -> None:
        self._calls = _calls()
        self._chunks = [c for lo, hi in _runs(file_spans) for c in _chunks(lo, hi)]
        self._anon = anon
        self._checked = False
        self._chunk: _Chunk | None = None
        self.moved = self.collapsed = 0
        self.seconds = 0.0

    @property
    def pending(self) -> bool:
        return self._calls is not None and bool(self._chunks or self._chunk or self._anon)

    def step(self) -> bool:
        """Do one piece; False where nothing was left to do."""
        if not self.pending:
            return False
        start = time.perf_counter()
        if not self._checked:  # the machine's state when the work starts
            self._checked = True
            total = sum(n for _, n in self._chunks)
            if total and not (_room_for(total) and _map_count_ok(len(self._chunks))):
                logger.info("weights stay on 4 KiB pages: no room for a copy of %d MiB",
                            total >> 20)
                self._chunks.clear()
            resident = _runs([r for lo, hi in self._anon  # (views: overlapping ranges)
                              for r in _resident(self._calls, lo, hi)])
            self._anon = [(lo, hi) for lo, hi in resident
                          if self._calls.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0]
        if self._chunks or self._chunk:
            self._move_piece()
        elif self._anon:
            self._collapse_piece()
        self.seconds += time.perf_counter() - start
        if not self.pending:
            logger.info("weights on 2 MiB pages: %d MiB moved, %d MiB collapsed, in %.2f s of "
                        "idle time", self.moved >> 20, self.collapsed >> 20, self.seconds)
        return True

    def _move_piece(self) -> None:
        if self._chunk is None:
            at, n = self._chunks.pop(0)
            # memory taken by others since the first check: leave the rest as it is
            self._chunk = _Chunk.start(self._calls, at, n) if _room_for(n) else None
            if self._chunk is None:
                logger.info("weights: %d MiB left on 4 KiB pages (memory is short)",
                            (n + sum(k for _, k in self._chunks)) >> 20)
                self._chunks.clear()
                return
        c = self._chunk
        if c.copy(self.PIECE):
            self._chunk = None
            if c.finish():
                self.moved += c.n
            else:  # the kernel refused the remap (the copy is in place of the file's pages)
                logger.info("weights: %d MiB left on 4 KiB pages (the kernel refused a remap)",
                            sum(k for _, k in self._chunks) >> 20)
                self._chunks.clear()

    def _collapse_piece(self) -> None:
        lo, hi = self._anon[0]  # marked MADV_HUGEPAGE in step's first call
        end = min(hi, lo + self.PIECE)
        if self._calls.madvise(lo, end - lo, _MADV_COLLAPSE) == 0:
            self.collapsed += end - lo
        if end == hi:
            self._anon.pop(0)
        else:
            self._anon[0] = (end, hi)


def _resident(calls: _Calls, lo: int, hi: int) -> list[tuple[int, int]]:
    """The runs of whole 2 MiB pages inside [lo, hi) whose every 4 KiB page is in memory: a
    collapse fills the missing ones, which would grow the process by memory nothing reads (a
    scratch buffer sized for the largest step)."""
    a, b = _interior(lo, hi)
    if b <= a:
        return []
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * ((b - a) // page))()
    if calls.mincore(a, b - a, vec) != 0:
        return []
    whole = (np.frombuffer(vec, dtype=np.uint8).reshape(-1, HUGE // page) & 1).all(axis=1)
    runs: list[tuple[int, int]] = []
    for i in np.flatnonzero(whole).tolist():
        start = a + i * HUGE
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + HUGE)
        else:
            runs.append((start, start + HUGE))
    return runs


def _chunks(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) as (start, bytes) pieces ending on CHUNK boundaries (so on 2 MiB ones)."""
    out = []
    while lo < hi:
        end = min(hi, (lo // CHUNK + 1) * CHUNK)
        out.append((lo, end - lo))
        lo = end
    return out


class _Chunk:
    """A copy of [at, at + n) being filled on huge pages, then mremapped onto `at`."""

    def __init__(self, calls: _Calls, at: int, n: int, base: int) -> None:
        self.calls, self.at, self.n, self.base = calls, at, n, base
        self.dst = base + (at - base) % HUGE  # dst = at (mod 2 MiB): its huge pages land on at's
        self.done = 0

    @classmethod
    def start(cls, calls: _Calls, at: int, n: int) -> _Chunk | None:
        base = calls.mmap(None, n + HUGE, _PROT_RW, _MAP_ANON, -1, 0)
        if base is None or base == _MAP_FAILED:
            return None
        chunk = cls(calls, at, n, base)
        calls.madvise(chunk.dst, n, _MADV_HUGEPAGE)
        return chunk

    def copy(self, nbytes: int) -> bool:
        """Copy the next `nbytes`; True once all is copied."""
        k = min(nbytes, self.n - self.done)
        ctypes.memmove(self.dst + self.done, self.at + self.done, k)
        self.done += k
        return self.done == self.n

    def finish(self) -> bool:
        """Put the copy at `at`; False where it stays on the file's pages."""
        calls, at, n, base, dst = self.calls, self.at, self.n, self.base, self.dst
        if calls.mremap(dst, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, at) != at:
            # The kernel refuses before it unmaps `at` (map count, flags); a failure after
            # that (out of kernel memory) would leave a hole, so put the copy there either way.
            if calls.mmap(at, n, _PROT_RW, _MAP_ANON | _MAP_FIXED, -1, 0) != at:
                raise MemoryError(f"huge pages: could not map {n} bytes back at {at:#x}")
            ctypes.memmove(at, dst, n)
            calls.munmap(base, n + HUGE)
            return False
        if dst > base:  # the ends of the region the copy did not use
            calls.munmap(base, dst - base)
        if base + n + HUGE > dst + n:
            calls.munmap(dst + n, base + n + HUGE - (dst + n))
        return True


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans widened to whole 4 KiB pages, sorted, overlapping or touching ones merged."""
    page = mmap.PAGESIZE
    runs: list[tuple[int, int]] = []
    for lo, hi in sorted((lo // page * page, -(-hi // page) * page) for lo, hi in spans):
        if runs and lo <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
        else:
            runs.append((lo, hi))
    return runs


def _room_for(nbytes: int) -> bool:
    """Whether the machine can hold `nbytes` more of anonymous memory with room to spare: a
    quarter of its memory, or 2 GiB if less, stays available after."""
    info = meminfo()
    if "MemAvailable" not in info or "MemTotal" not in info:
        return False
    return info["MemAvailable"] - nbytes >= min(info["MemTotal"] // 4, 2 << 30)


def _map_count_ok(extra: int) -> bool:
    """Whether `extra` more mappings stay far below vm.max_map_count (each remapped chunk
    splits the file's map)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps") as f:
            count = sum(1 for _ in f)
    except (OSError, ValueError):
        return False
    return count + 2 * extra < limit // 2
