"""loom.loader.pagein reads a model's files into the page cache before the first request, and
loom.loader.release maps the pages the model holds: checked with mincore (page cache) and the
mapping's Rss in /proc/self/smaps (this process)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import pytest

from loom.loader import pagein
from loom.loader.release import _free_spans, _held_spans, populate_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page cache")

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _address(buf: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(view)
    del view  # the map can close again
    return address


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore on a fresh map)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        n = -(-len(buf) // PAGE)
        vec = ctypes.create_string_buffer(n)
        assert _libc.mincore(_address(buf), len(buf), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw)
    finally:
        buf.close()


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _rss_kib_of_map(address: int) -> int:
    """The Rss line of this process's mapping that starts at `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:#x}")


def _write(path: Path, pages: int) -> Path:
    path.write_bytes(os.urandom(pages * PAGE))
    return path


def test_readahead_then_wait_leaves_the_file_in_the_page_cache(tmp_path: Path) -> None:
    f = _write(tmp_path / "m.gguf", 256)
    _evict(f)
    if _cached_pages(f) > 128:  # a file system that keeps it anyway (tmpfs): nothing to see
        pytest.skip("this file system does not drop the file's pages")
    pagein.wait(f)  # starts the read-ahead (none was started for this path) and joins it
    assert _cached_pages(f) == 256


def test_model_files_of_a_folder_and_a_file(tmp_path: Path) -> None:
    a = _write(tmp_path / "model-00001.safetensors", 1)
    b = _write(tmp_path / "model-00002.safetensors", 1)
    (tmp_path / "config.json").write_text("{}")
    assert pagein.model_files(tmp_path) == [a, b]
    assert pagein.model_files(a) == [a]
    assert pagein.model_files(tmp_path / "missing.gguf") == []
    pagein.wait(tmp_path / "missing.gguf")  # nothing to read: returns


def test_populate_maps_the_held_pages_into_this_process(tmp_path: Path) -> None:
    f = _write(tmp_path / "w.bin", 512)
    with open(f, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # as read_gguf maps
    try:
        start = _address(buf)
        assert _rss_kib_of_map(start) == 0
        # a held span from the middle of page 200 to the middle of page 216: pages 200..216
        assert populate_pages(start + 200 * PAGE + 100, start + 216 * PAGE + 100) == 17 * PAGE
        # those at least (the kernel maps whole folios around them: up to the whole file here)
        assert _rss_kib_of_map(start) * 1024 >= 17 * PAGE
    finally:
        buf.close()


def test_free_and_held_spans_split_a_tensor() -> None:
    held = [(10, 20), (12, 15), (30, 40)]  # sorted by start; (12, 15) lies inside (10, 20)
    assert list(_free_spans(0, 35, held)) == [(0, 10), (20, 30)]
    assert list(_held_spans(0, 35, held)) == [(10, 20), (12, 15), (30, 35)]
