"""Read a model's files into the page cache in the background, from the moment their path is
known, and make the load wait for it to finish.

Loom maps a GGUF file and keeps K-quant blocks as views of the map (docs/kquants.md): nothing
reads them until the first request's forward, whose kernels walk rows across the file, so where
the file was not in the page cache (a server's first start after a download or a reboot) that
request faulted it in a few pages at a time: SmolLM2-1.7B's shape in Q4_K_M, 1 GB, gave its
first token 4.8 s after /health against 0.3-0.5 s for the next requests. `readahead` starts a
thread that streams the files into the page cache in large sequential reads (`sendfile` to
/dev/null: no copy, ~1 GB/s from this machine's disk) while the process imports torch and builds
the model; `wait` (called at the end of the load) returns once it is done, so /health means the
weights are in memory, as llama.cpp's `MAP_POPULATE` does. On a warm page cache it costs ~0.02 s
of CPU a GB. Imports nothing heavy: `loom serve` calls it before importing torch.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_CHUNK = 64 << 20
_started: dict[Path, threading.Thread] = {}
_lock = threading.Lock()


def model_files(path: Path) -> list[Path]:
    """The files a load of `path` reads: a .gguf file itself, a folder's weight files."""
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted([*path.glob("*.safetensors"), *path.glob("*.gguf")])
    return []


def _stream(files: list[Path]) -> None:
    with open(os.devnull, "wb") as null:
        for path in files:
            try:
                with open(path, "rb") as f:
                    size, offset = os.fstat(f.fileno()).st_size, 0
                    while offset < size:
                        sent = os.sendfile(null.fileno(), f.fileno(), offset,
                                           min(_CHUNK, size - offset))
                        if sent <= 0:  # the file shrank under us
                            break
                        offset += sent
            except OSError as e:  # gone, unreadable, or sendfile refused: the load reads it
                logger.debug("read-ahead of %s stopped: %s", path, e)


def readahead(path: Path) -> None:
    """Start reading `path`'s model files into the page cache on a daemon thread (once per
    path; a no-op where the platform has no sendfile)."""
    if not hasattr(os, "sendfile"):
        return
    path = Path(path).resolve()
    with _lock:
        if path in _started:
            return
        thread = threading.Thread(target=_stream, args=(model_files(path),),
                                  name="loom-readahead", daemon=True)
        _started[path] = thread
    thread.start()


def wait(path: Path) -> None:
    """Return once `path`'s read-ahead (started here if it was not) has finished."""
    readahead(path)
    thread = _started.get(Path(path).resolve())
    if thread is not None:
        thread.join()
