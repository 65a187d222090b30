"""The tokenizer's fast path (tokenizer.json read by `tokenizers`, templates through transformers'
renderer, no transformers tokenizer built) against `AutoTokenizer`, the reference."""

from __future__ import annotations

import json
import sys

import pytest
from transformers import AutoTokenizer

from loom.loader.resolve import ModelSource, resolve_model
from loom.tokenizer.tokenizer import ChatTemplateError, Tokenizer, _tokenizer_folder

TEXTS = [
    "The capital of France is", "", " ", "  leading and trailing  ", "\n\n\tTabs\r\n",
    "café naïve 日本語 😀 👨‍👩‍👧 🇫🇷 e\u0301", "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|>text<|im_end|>", "1234567890 3.14159",
    "a" * 300, "Ġ weird Ċ bytes \x00\x01",
    "A long text, encoded on the tokenizers' thread pool. " * 60,  # past 2048 characters
]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "ünïcode 😀"}],
    [{"role": "user", "content": "Hi", "name": None}],  # None-valued keys are dropped
]


@pytest.fixture(scope="module")
def pair():
    source = resolve_model(None)
    Tokenizer.from_source(source)  # converts and caches the GGUF tokenizer if needed
    fast = Tokenizer.from_source(source, (2,))
    assert not fast.hf_loaded, "the packaged model's cached tokenizer takes the fast path"
    return fast, AutoTokenizer.from_pretrained(str(_tokenizer_folder(source)))


def test_encode_decode_match_transformers(pair) -> None:
    fast, ref = pair
    for text in TEXTS:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), text
    ids = list(range(0, 49152, 97)) + [0, 1, 2, 3]
    for skip in (True, False):
        assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert fast.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert fast.vocab_size == len(ref)
    assert fast.eos_token_ids == (2,) and ref.eos_token_id == 2
    assert fast.special_tokens == ref.special_tokens_map
    assert not fast.hf_loaded


def test_chat_templates_match_transformers(pair) -> None:
    fast, ref = pair
    assert fast.chat_template == ref.chat_template
    for conv in CONVERSATIONS:
        for gen in (True, False):
            expected = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert fast.apply_chat_template(conv, add_generation_prompt=gen) == expected
    custom = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}" \
             "{% endfor %}{{ tools | tojson }}{{ extra }}"
    expected = ref.apply_chat_template(CONVERSATIONS[1], tokenize=False, chat_template=custom,
                                       tools=[TOOL], extra="X")
    assert fast.apply_chat_template(CONVERSATIONS[1], chat_template=custom, tools=[TOOL],
                                    extra="X") == expected
    prefill = [*CONVERSATIONS[1], {"role": "assistant", "content": "Four, as"}]
    expected = ref.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    assert expected.endswith("Four, as")  # the last message left open: the model continues it
    assert fast.apply_chat_template(prefill, add_generation_prompt=False,
                                    continue_final_message=True) == expected
    assert fast.encode_chat(CONVERSATIONS[0]) == ref.apply_chat_template(
        CONVERSATIONS[0], tokenize=True, add_generation_prompt=True, return_dict=False)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        fast.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="no way"):
        fast.apply_chat_template(CONVERSATIONS[0], chat_template="{{ raise_exception('no way') }}")
    assert not fast.hf_loaded


def test_hf_is_loaded_on_demand_and_then_authoritative() -> None:
    tok = Tokenizer.from_source(resolve_model(None))
    assert not tok.hf_loaded
    tok.hf.chat_template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"  # --chat-template
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "<Hi>"
    assert tok.chat_template == tok.hf.chat_template


@pytest.mark.parametrize("edit", [{"tokenizer_class": "LlamaTokenizerFast"},
                                  {"add_bos_token": True}, {"clean_up_tokenization_spaces": True},
                                  {"chat_template": [{"name": "default", "template": "x"}]}])
def test_other_folders_load_through_transformers(tmp_path, edit) -> None:
    folder = _tokenizer_folder(resolve_model(None))
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    if "chat_template" in edit:
        (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **edit}))
    tok = Tokenizer.from_source(ModelSource("hf", tmp_path, "t"))
    assert tok.hf_loaded
    assert tok.encode("Hello world") == tok.hf.encode("Hello world")


def test_fast_path_imports_no_transformers_tokenizer(tmp_path) -> None:
    import subprocess

    code = ("import sys; from loom.loader.resolve import resolve_model; "
            "from loom.tokenizer.tokenizer import Tokenizer; "
            "t = Tokenizer.from_source(resolve_model(None)); t.decode(t.encode('hi')); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
