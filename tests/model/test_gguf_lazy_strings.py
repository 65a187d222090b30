"""The GGUF header's long string arrays (a vocabulary, its merges) are stepped over at parse and
decoded on first use: the same values as `GGUFReader`'s, counted and searched without decoding."""

from __future__ import annotations

import pytest
from gguf import GGUFReader

from loom.loader.gguf_file import GGUFFormatError, read_gguf
from loom.loader.resolve import default_gguf_path

pytestmark = pytest.mark.slow  # loads real GGUF / tokenizer files: seconds each

def test_vocabulary_is_counted_and_searched_without_decoding() -> None:
    path = default_gguf_path()
    ours = read_gguf(path)
    tokens = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    assert ours.count("tokenizer.ggml.tokens") == len(tokens) == 49152
    assert "tokenizer.ggml.tokens" not in {k for k, v in dict.items(ours.fields)
                                           if isinstance(v, list)}  # not decoded yet
    for text in ("<|im_end|>", tokens[12345], "Ġthe"):
        assert ours.string_index("tokenizer.ggml.tokens", text) == tokens.index(text)
    assert ours.string_index("tokenizer.ggml.tokens", "no such token \u2603") is None
    assert ours.count("no.such.key") == 0
    assert ours.get("tokenizer.ggml.tokens") == tokens  # decoded on first read
    assert ours.string_index("tokenizer.ggml.tokens", "<|im_end|>") == tokens.index("<|im_end|>")


def test_a_file_cut_inside_the_vocabulary_is_refused(tmp_path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(default_gguf_path(), "rb") as f:
        cut.write_bytes(f.read(200_000))  # the header's token strings run past this
    with pytest.raises(GGUFFormatError, match="runs past the end"):
        read_gguf(cut)
