"""A GGUF tokenizer cache naming a model's own class (Gemma's `GemmaTokenizer`) is compared once
with tokenizer.json alone (loom.tokenizer.fast_check) and read straight from then on where the two
agree; a folder where they differ keeps transformers, without comparing again."""

from __future__ import annotations

import json
import shutil

import pytest

from loom.loader.resolve import resolve_model
from loom.tokenizer import fast_check
from loom.tokenizer import tokenizer as tokenizer_module
from loom.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # loads real GGUF / tokenizer files: seconds each

TEXTS = ["The capital of France is", "  two  spaces ", "<|im_start|>user\nHi<|im_end|>", "日本語 😀"]


@pytest.fixture
def own_class_cache(tmp_path, monkeypatch):
    """The packaged model's converted tokenizer, copied into a fresh cache, its config naming
    GPT2Tokenizer (a model's own class) instead of the generic one."""
    source = resolve_model(None)
    Tokenizer.from_source(source)  # converts into the real cache if needed
    folder = tokenizer_module._tokenizer_folder(source)
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    cached = tokenizer_module._tokenizer_folder(source) or (
        tokenizer_module._cache_dir() / tokenizer_module._gguf_cache_key(source.path))
    shutil.copytree(folder, cached, dirs_exist_ok=True)
    (cached / fast_check.MARKER).unlink(missing_ok=True)
    config_path = cached / "tokenizer_config.json"
    config = {**json.loads(config_path.read_text()), "tokenizer_class": "GPT2Tokenizer"}
    config_path.write_text(json.dumps(config))
    return source, cached


def test_own_class_cache_is_checked_once_then_read_straight(own_class_cache, monkeypatch) -> None:
    source, cached = own_class_cache
    first = Tokenizer.from_source(source, (2,))
    assert first.hf_loaded  # transformers' class, then the comparison
    assert fast_check.verdict(cached) is True
    second = Tokenizer.from_source(source, (2,))
    assert not second.hf_loaded
    for text in TEXTS:
        ids = second.encode(text)
        assert ids == first.hf.encode(text)
        assert second.decode(ids) == first.hf.decode(ids, skip_special_tokens=True)
    assert second.eos_token_ids == first.eos_token_ids
    assert second.special_tokens == first.special_tokens
    assert second.chat_template == first.chat_template
    # another transformers release may build the class differently: compared again
    monkeypatch.setattr(fast_check.importlib.metadata, "version", lambda name: "0.0")
    assert fast_check.verdict(cached) is None


def test_a_cache_that_differs_keeps_transformers(own_class_cache) -> None:
    source, cached = own_class_cache
    hf = Tokenizer.from_source(source).hf  # the first start: compared, and they agree
    backend, special, template = tokenizer_module._load_fast(cached, checked=True)
    assert fast_check.same_tokens(backend, special, template, hf) is None
    other = {**special, "eos_token": "<|endoftext|>"}
    assert fast_check.same_tokens(backend, other, template, hf) == "special tokens differ"
    assert fast_check.same_tokens(backend, special, "{{ x }}", hf) == "chat templates differ"
    assert not fast_check.mark(cached, (backend, special, "{{ x }}"), hf)  # recorded as such
    assert fast_check.verdict(cached) is False
    marker = (cached / fast_check.MARKER).read_text()
    assert Tokenizer.from_source(source).hf_loaded  # no fast path, and no second comparison
    assert (cached / fast_check.MARKER).read_text() == marker
    config_path = cached / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "x": 1}))
    assert fast_check.verdict(cached) is None  # the files changed: the verdict no longer holds
