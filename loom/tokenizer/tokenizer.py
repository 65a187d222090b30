"""Tokenizer and chat template, from an HF folder or from a GGUF file's own metadata.

Tokenization and template rendering are the `transformers` tokenizer's (backed by `tokenizers`);
Loom never uses `transformers` modeling code. A GGUF tokenizer is converted once and cached as an
ordinary tokenizer folder, so later starts skip the conversion.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from loom.loader.resolve import ModelSource

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


def _cache_dir() -> Path:
    root = os.environ.get("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom"
    return Path(root) / "tokenizers"


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]


def _load_hf_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(str(source.path))
    cached = _cache_dir() / _gguf_cache_key(source.path)
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("converting the GGUF tokenizer of %s (once; cached in %s)", source.path, cached)
    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    try:
        tok.save_pretrained(str(cached))
    except OSError as e:  # a read-only home must not stop serving
        logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok


class Tokenizer:
    """Encode, decode and render chat templates for one model."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer  # the raw `tokenizers.Tokenizer`
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_source(cls, source: ModelSource, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        return cls(_load_hf_tokenizer(source), eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(token_ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if chat_template is None and not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass one with --chat-template")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, tools=tools, **template_kwargs,
            )
        except Exception as e:  # jinja errors (raise_exception in templates) reach users as 400s
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The template already contains any BOS token.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)
