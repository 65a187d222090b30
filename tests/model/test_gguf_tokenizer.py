"""A GGUF file's tokenizer, converted once by Loom without transformers' GGUF config (the class
picked from the architecture, loom.tokenizer.tokenizer._gguf_tokenizer_class), is the tokenizer
AutoTokenizer builds from the same file: the same class and the same saved files, byte for
byte. The real files (the packaged SmolLM2, Gemma 3 270M) and llama.cpp's converter's files of
tiny checkpoints of the other families."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loom.loader.gguf_file import read_gguf
from loom.loader.resolve import default_gguf_path
from loom.tokenizer.tokenizer import _gguf_tokenizer_class
from tests.gguf_files import gemma3_gguf_path

TEXTS = ["Hello world! <start_of_turn>user\nHi 123  ünïcödé 日本語\t\n  spaces",
         "def f(x):\n    return x**2  # ok\n\n\n"]


def _class(path: Path):  # noqa: ANN202
    return _gguf_tokenizer_class(path, read_gguf(path).get("general.architecture"))


def _saved(tok, folder: Path) -> dict[str, bytes]:
    tok.save_pretrained(str(folder))
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def check_same_as_auto_tokenizer(path: Path, tmp_path: Path, expected_class: str) -> None:
    from transformers import AutoTokenizer

    cls = _class(path)
    assert cls is not None and cls.__name__ == expected_class
    ours = cls.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours) is type(ref)
    assert _saved(ours, tmp_path / "ours") == _saved(ref, tmp_path / "ref")
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref(text)["input_ids"]


@pytest.mark.slow
def test_packaged_smollm2(tmp_path) -> None:
    check_same_as_auto_tokenizer(default_gguf_path(), tmp_path, "TokenizersBackend")


@pytest.mark.slow
def test_real_gemma3(tmp_path) -> None:
    check_same_as_auto_tokenizer(gemma3_gguf_path(), tmp_path, "GemmaTokenizer")


@pytest.mark.slow
def test_converter_file_of_a_registered_tokenizer_class(tmp_path) -> None:
    from tests.model.test_llama_cpp_converter import convert

    path, _ = convert("qwen3-moe", tmp_path, "f32")
    alone = tmp_path / "alone"  # the GGUF without the checkpoint's folder beside it
    alone.mkdir()
    shutil.move(path, alone / path.name)
    check_same_as_auto_tokenizer(alone / path.name, tmp_path, "Qwen2Tokenizer")


@pytest.mark.slow
def test_converter_file_transformers_cannot_configure(tmp_path, monkeypatch) -> None:
    """A GGUF of an architecture transformers' GGUF loader builds no config for (AutoTokenizer
    raises "not supported yet" on it: Granite 4.0-H here; Nemotron-H, SmolLM3, Granite 3, ...
    alike) gets its tokenizer from the generic backend, which reads the file's tokenizer
    alone: the checkpoint's tokenizer's ids, through the Tokenizer the engine loads."""
    name = "granite4-h"
    from transformers import AutoTokenizer

    from loom.loader.resolve import resolve_model
    from loom.tokenizer.tokenizer import Tokenizer
    from tests.model.test_llama_cpp_converter import convert

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    path, folder = convert(name, tmp_path, "f32")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.move(path, alone / path.name)
    with pytest.raises(ValueError, match="not supported yet"):
        AutoTokenizer.from_pretrained(str(alone), gguf_file=path.name)
    assert _class(alone / path.name).__name__ == "TokenizersBackend"
    ours = Tokenizer.from_source(resolve_model(str(alone / path.name)))
    ref = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]


def test_files_beside_the_gguf_leave_it_to_auto_tokenizer(tmp_path) -> None:
    path = tmp_path / default_gguf_path().name
    path.symlink_to(default_gguf_path())
    assert _class(path) is not None
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert _class(path) is None


def test_the_cache_holds_merges_as_strings_that_encode_the_same(tmp_path, monkeypatch) -> None:
    """The converted tokenizer.json keeps BPE merges as "a b" strings (parsed faster than
    pairs, loom.tokenizer.tokenizer._compact_merges): the same ids as the pairs it was saved
    with, on the packaged model; merges holding a space are left as pairs. The file's folder
    of the earlier format goes once the new one is written."""
    import json

    from tokenizers import Tokenizer as RawTokenizer

    from loom.loader.resolve import resolve_model
    from loom.tokenizer import tokenizer as tokenizer_module

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_model(None)
    old = tokenizer_module._cache_dir() / tokenizer_module._gguf_cache_key(source.path, 1)
    (old / "tokenizer.json").parent.mkdir(parents=True)
    (old / "tokenizer.json").write_text("{}")  # the same file's format-1 folder, dropped below
    tok = tokenizer_module.Tokenizer.from_source(source)  # converts into the fresh cache
    folder = tokenizer_module._tokenizer_folder(source)
    assert folder != old and folder.is_dir() and not old.exists()
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    merges = data["model"]["merges"]
    assert len(merges) > 40000 and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    pairs = {**data, "model": {**data["model"], "merges": [m.split(" ") for m in merges]}}
    theirs = RawTokenizer.from_str(json.dumps(pairs))
    for text in TEXTS:
        assert tok.encode(text) == theirs.encode(text, add_special_tokens=False).ids
    spaced = tmp_path / "spaced.json"
    kept = {"model": {"type": "BPE", "merges": [["a b", "c"], ["d", "e"]]}}
    spaced.write_text(json.dumps(kept))
    tokenizer_module._compact_merges(spaced)
    assert json.loads(spaced.read_text()) == kept
