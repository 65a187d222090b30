"""Benchmark prompts: synthetic ones of exact token lengths from a fixed seed, or a JSONL file.

A synthetic prompt is random token ids from the tokenizer's normal vocabulary (no special or
added tokens, no pieces that decode to a broken UTF-8 character), decoded to text; because
re-encoding text can merge or split tokens, the text is re-encoded and trimmed or topped up
until `encode(text)` has exactly the asked length. Every server then receives the same text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

_MAX_ADJUST_ROUNDS = 64


class DatasetError(ValueError):
    """A dataset file is missing or malformed, or prompts of the asked length cannot be made."""


class BenchTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    prompt: str  # the text sent to the server
    prompt_len: int  # its length in tokens (our tokenizer, no special tokens)
    output_len: int  # max_tokens asked for


def normal_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids of ordinary vocabulary pieces: not special, not added, decoding to whole characters."""
    hf = getattr(tokenizer, "hf", tokenizer)
    size = int(getattr(tokenizer, "vocab_size", 0) or len(hf))
    excluded = set(getattr(hf, "all_special_ids", []) or [])
    excluded |= set((getattr(hf, "added_tokens_decoder", None) or {}).keys())
    ids = [i for i in range(size) if i not in excluded]
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=True)
    else:
        texts = [tokenizer.decode([i]) for i in ids]
    keep = [i for i, t in zip(ids, texts) if t.strip() and "\ufffd" not in t]
    if not keep:
        raise DatasetError("the tokenizer has no ordinary vocabulary to draw prompts from")
    return np.asarray(keep, dtype=np.int64)


def exact_length_text(
    tokenizer: BenchTokenizer, rng: np.random.Generator, vocab: np.ndarray, length: int
) -> str:
    """Random text that encodes (without special tokens) to exactly `length` tokens."""
    if length < 1:
        raise DatasetError(f"input length must be at least 1, got {length}")
    ids = [int(i) for i in rng.choice(vocab, size=length)]
    for _ in range(_MAX_ADJUST_ROUNDS):
        text = tokenizer.decode(ids)
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == length:
            return text
        if len(enc) > length:
            ids = enc[:length]
        else:
            ids = enc + [int(i) for i in rng.choice(vocab, size=length - len(enc))]
    raise DatasetError(f"could not make a prompt of exactly {length} tokens")


def synthetic_prompts(
    tokenizer: BenchTokenizer, num_prompts: int, input_len: int, output_len: int, seed: int,
    vocab: np.ndarray | None = None,
) -> list[BenchPrompt]:
    """`num_prompts` different prompts of `input_len` tokens each; the same for the same seed."""
    vocab = normal_token_ids(tokenizer) if vocab is None else vocab
    rng = np.random.default_rng(seed)
    return [BenchPrompt(exact_length_text(tokenizer, rng, vocab, input_len), input_len, output_len)
            for _ in range(num_prompts)]


def load_jsonl(
    path: str | Path, tokenizer: BenchTokenizer, num_prompts: int | None, output_len: int
) -> list[BenchPrompt]:
    """Lines of {"prompt": text, "output_len": n (optional)}; cycled if fewer than asked."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    items: list[BenchPrompt] = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise DatasetError(f"{path}:{n}: each line needs a \"prompt\" string")
            out = obj.get("output_len", obj.get("max_tokens", output_len))
            if not isinstance(out, int) or out < 1:
                raise DatasetError(f"{path}:{n}: output_len must be a positive integer, "
                                   f"got {out!r}")
            text = obj["prompt"]
            items.append(BenchPrompt(text, len(tokenizer.encode(text, add_special_tokens=False)),
                                     out))
    if not items:
        raise DatasetError(f"{path}: no prompts")
    if num_prompts is None:
        return items
    return [items[i % len(items)] for i in range(num_prompts)]
