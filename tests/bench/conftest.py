from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The packaged SmolLM2's tokenizer, loaded once for the bench tests."""
    from loom.bench.cli import load_tokenizer

    return load_tokenizer(None)
