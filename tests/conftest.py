from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
