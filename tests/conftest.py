from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _memoize_gguf_reads() -> None:
    """transformers' GGUF loading, the reference of the fidelity tests, parses a file's metadata
    twice (the config, then the tensors or the tokenizer: `GGUFReader` ~5 s each on SmolLM2's,
    more on Gemma 3's 262k-token vocabulary) and builds gguf's `TensorNameMap` once a module
    (397 times for SmolLM2: ~10 s). Both are pure reads, memoized for the run: readers by the
    file's identity (a file written again is read again), name maps by (arch, blocks)."""
    import functools

    import gguf

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    reader_class = gguf.GGUFReader

    @functools.lru_cache(maxsize=2)  # the file being loaded (Gemma 3's holds ~1 GB of views)
    def read(path: str, identity: tuple[int, int, int, int]) -> gguf.GGUFReader:
        return reader_class(path, "r")

    def reader(path, mode="r"):
        if mode != "r":
            return reader_class(path, mode)
        st = os.stat(path)
        return read(os.path.realpath(path), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    gguf.GGUFReader = reader


_memoize_gguf_reads()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "background(name, argv, env): a job the test waits for, "
                            "started when collection ends (tests/background.py)")


def pytest_collection_finish(session) -> None:
    """The background jobs of the tests this run will run (tests/background.py), started now."""
    from tests import background

    for item in session.items:
        for mark in item.iter_markers("background"):
            background.start(*mark.args)


def pytest_sessionfinish(session) -> None:
    from tests import background

    background.stop_all()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """torch's thread count as it was before each test: `LLM(num_threads=...)` and tensor
    parallelism's rank 0 set the process's count, and a test that left it at 1 ran every test
    after it on one core."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own fp32 model of the packaged SmolLM2 GGUF (`from_pretrained(gguf_file=
    ...)`, which dequantizes the file in Python: ~25 s), read once for the whole run."""
    import torch
    from transformers import AutoModelForCausalLM

    from loom.loader.resolve import default_gguf_path

    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_auto_tokenizer():
    """transformers' AutoTokenizer of the packaged SmolLM2 GGUF (~9 s: its config from the
    file's metadata first), read once for the whole run. Copy it before changing it."""
    from transformers import AutoTokenizer

    from loom.loader.resolve import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
