"""Weights onto huge pages while idle (loom/loader/hugepages.py): a private file map's spans are
copied to anonymous memory at the same addresses, the model's own tensors collapsed in place;
the bytes every view reads never change, and memory nothing touched stays untouched."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch

from loom.loader import hugepages
from loom.loader.hugepages import HUGE, HugePager

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory maps")


def _vma(addr: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) of the mapping holding `addr`, with its start/end."""
    found: dict[str, int] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                if found is not None:
                    return found
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= addr < hi:
                    found = {"start": lo, "end": hi, "anon": int(line.split()[4] == "0"
                                                                 and len(line.split()) < 6)}
            elif found is not None and line.endswith("kB\n"):
                found[head.rstrip(":")] = int(line.split()[1])
    assert found is not None, f"{addr:#x} is not mapped"
    return found


def _run(pager: HugePager) -> int:
    steps = 0
    while pager.step():
        steps += 1
        assert steps < 10_000
    assert not pager.pending and not pager.step()
    return steps


def _resident(addr: int, nbytes: int) -> np.ndarray:
    vec = (ctypes.c_ubyte * (nbytes // mmap.PAGESIZE))()
    assert hugepages._calls().mincore(addr, nbytes, vec) == 0
    return np.frombuffer(vec, dtype=np.uint8) & 1


def test_file_spans_move_with_their_bytes(tmp_path) -> None:
    """A span of a copy-on-write file map (one page written in place, as the loader's in-place
    dequantization does) is moved: the same bytes at the same addresses, no longer the file's
    pages, on huge pages where the kernel gives them."""
    size = 3 * hugepages.CHUNK // 2 + 12345  # two chunks, ends off any page boundary
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = np.frombuffer(buf, dtype=np.uint8)
    view[5 * mmap.PAGESIZE + 7] ^= 0xFF  # a private (dirty) page: the map's bytes, not the file's
    want = view.copy()
    base = view.ctypes.data
    lo, hi = base + 1000, base + size - 3000
    assert _vma(base + size // 2)["Rss"] > 0 and not _vma(base + size // 2)["anon"]
    pager = HugePager([(lo, hi), (lo + 10, lo + 20)], [])  # overlapping spans: one run
    _run(pager)
    page = mmap.PAGESIZE
    assert pager.moved == -(-hi // page) * page - lo // page * page
    assert np.array_equal(view, want)  # every byte the views read, the dirty page's too
    middle = _vma(base + size // 2)
    assert middle["anon"]  # anonymous memory now at the file map's addresses
    if hugepages.enabled():
        assert sum(_vma(a)["AnonHugePages"] for a in (base + HUGE * 2, base + size - HUGE * 3)) > 0
    del view
    buf.close()  # unmaps the whole range, moved chunks included


def test_anon_tensors_collapse_only_where_resident() -> None:
    """The model's own tensors: whole resident 2 MiB pages are collapsed in place (their bytes
    unchanged); pages nothing touched stay out of memory (no growth for a scratch buffer)."""
    n = 8 * HUGE
    t = torch.empty(n + 2 * HUGE, dtype=torch.uint8)
    a = -(-t.data_ptr() // HUGE) * HUGE  # the first whole huge page inside
    off = a - t.data_ptr()
    touched = torch.randint(0, 256, (4 * HUGE,), dtype=torch.uint8, generator=torch.Generator()
                            .manual_seed(0))
    t[off : off + 4 * HUGE] = touched
    if _resident(a + 4 * HUGE, 4 * HUGE).any():
        pytest.skip("the allocator handed out memory already touched")
    pager = HugePager([], [(t.data_ptr(), t.data_ptr() + t.numel())])
    _run(pager)
    assert torch.equal(t[off : off + 4 * HUGE], touched)
    assert not _resident(a + 4 * HUGE, 4 * HUGE).any()  # the untouched half: still not in memory
    assert pager.collapsed in (0, 4 * HUGE)  # 0 where the kernel has no MADV_COLLAPSE (< 6.1)
    if pager.collapsed and hugepages.enabled():
        assert _vma(a)["AnonHugePages"] >= 4 * HUGE // 1024


def test_no_room_no_copy(monkeypatch) -> None:
    """Where the machine has no room for the copies the file's pages stay as they are."""
    monkeypatch.setattr(hugepages, "_room_for", lambda nbytes: False)
    buf = mmap.mmap(-1, 4 * HUGE)
    view = np.frombuffer(buf, dtype=np.uint8)
    pager = HugePager([(view.ctypes.data, view.ctypes.data + view.nbytes)], [])
    assert pager.pending and pager.step() and not pager.pending and not pager.step()
    assert pager.moved == 0
    del view
    buf.close()


def test_environment(monkeypatch) -> None:
    """LOOM_HUGE_PAGES=0: nothing; =tensors (data-parallel replicas, which share the file's
    pages): the loader's tensors only."""
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.enabled()
    monkeypatch.setenv(hugepages.ENV, "tensors")
    assert not hugepages.copies_allowed()
    monkeypatch.delenv(hugepages.ENV)
    assert hugepages.copies_allowed()
