"""llama.cpp's `convert_hf_to_gguf.py` (unpacked by `make install-test`), run as its command
line would, each conversion in a process of its own, forked from one that has already imported
the converter, torch and transformers: a fresh `python convert_hf_to_gguf.py` spends ~5 of its
~7 s on those imports, and the suite converts some 25 tiny checkpoints. The converter puts its
own `gguf` package first on `sys.path`, so it never runs in the test process itself."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest

CONVERTER = Path(sys.prefix) / "share" / "llama-cpp-converter" / "convert_hf_to_gguf.py"
# imported once by the fork server (multiprocessing's forkserver context): the converter
PRELOAD = "tests.llama_cpp_converter_preload"


def _main(argv: list[str], log: str) -> None:
    """In the forked child: the converter's main() with `argv`, its output to `log`."""
    import importlib

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [str(CONVERTER), *argv]
    importlib.import_module(PRELOAD).CONVERTER_MODULE.main()


def require_converter() -> None:
    if not CONVERTER.exists():
        pytest.skip(f"no llama.cpp converter at {CONVERTER} (make install-test unpacks it)")


def run_converter(argv: list[str], log: Path, timeout: float = 300) -> tuple[int, str]:
    """(the exit code, the converter's output) of `convert_hf_to_gguf.py *argv`."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, PRELOAD])
    proc = ctx.Process(target=_main, args=(argv, str(log)), daemon=True)
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        return -9, f"timed out after {timeout} s"
    return proc.exitcode, log.read_text() if log.exists() else ""
