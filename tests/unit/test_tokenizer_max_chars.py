"""Tokenizer.max_token_chars is kept beside a GGUF's converted tokenizer (Loom's cache) and
recomputed when tokenizer.json changes."""

from __future__ import annotations

import json

import pytest

from loom.loader.resolve import resolve_model
from loom.tokenizer import tokenizer as tok_mod
from loom.tokenizer.tokenizer import Tokenizer


@pytest.mark.slow  # four tokenizer loads
def test_max_token_chars_is_cached_beside_the_gguf_tokenizer(monkeypatch) -> None:
    source = resolve_model(None)  # the packaged SmolLM2 GGUF
    first = Tokenizer.from_source(source)
    folder = tok_mod._tokenizer_folder(source)
    assert folder is not None
    cached = folder / tok_mod._MAX_CHARS_FILE
    cached.unlink(missing_ok=True)
    longest = first._longest_token()
    assert longest > 1 and first.max_token_chars == longest
    saved = json.loads(cached.read_text())
    assert saved["chars"] == longest
    assert saved["tokenizer.json"] == tok_mod._file_stamp(folder / "tokenizer.json")

    def boom(self: Tokenizer) -> int:
        raise AssertionError("the vocabulary was listed again")

    monkeypatch.setattr(Tokenizer, "_longest_token", boom)
    assert Tokenizer.from_source(source).max_token_chars == longest  # read from the file
    # a file stamped for another tokenizer.json is not trusted
    cached.write_text(json.dumps({"tokenizer.json": [1, 2], "chars": 3}))
    with pytest.raises(AssertionError, match="listed again"):
        Tokenizer.from_source(source).max_token_chars
    monkeypatch.undo()
    assert Tokenizer.from_source(source).max_token_chars == longest
    assert json.loads(cached.read_text())["chars"] == longest
