"""Model names: short aliases (`smollm2`, `qwen3:0.6b`), `org/repo` and `org/repo:QUANT`.

A name parses into a `ModelRef` without any I/O: the Hugging Face repo, and for GGUF repos the
quantization tag that picks the file (Ollama's `model:tag`). `smollm2` alone is the GGUF packaged
with Loom; it needs no download.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PACKAGED = "smollm2"


class ModelNameError(ValueError):
    """The text is neither an alias nor `org/repo[:TAG]`."""


@dataclass(frozen=True)
class Alias:
    repo_id: str
    quant: str  # the default tag: the GGUF file whose name holds it
    about: str


# GGUF repos whose default quantization Loom's loader reads (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16).
ALIASES: dict[str, Alias] = {
    "smollm2:135m": Alias("bartowski/SmolLM2-135M-Instruct-GGUF", "Q8_0",
                          "SmolLM2 135M Instruct (Hugging Face)"),
    "smollm2:360m": Alias("bartowski/SmolLM2-360M-Instruct-GGUF", "Q8_0",
                          "SmolLM2 360M Instruct (Hugging Face)"),
    "smollm2:1.7b": Alias("bartowski/SmolLM2-1.7B-Instruct-GGUF", "Q4_0",
                          "SmolLM2 1.7B Instruct (Hugging Face)"),
    "qwen2.5:0.5b": Alias("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Q8_0", "Qwen2.5 0.5B Instruct"),
    "qwen2.5:1.5b": Alias("Qwen/Qwen2.5-1.5B-Instruct-GGUF", "Q4_0", "Qwen2.5 1.5B Instruct"),
    "qwen3:0.6b": Alias("Qwen/Qwen3-0.6B-GGUF", "Q8_0", "Qwen3 0.6B"),
    "llama3.2:1b": Alias("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_0",
                         "Llama 3.2 1B Instruct (Meta)"),
    "gemma3:270m": Alias("ggml-org/gemma-3-270m-it-GGUF", "Q8_0", "Gemma 3 270M instruct"),
}
# A family name alone means its smallest size.
DEFAULT_SIZES = {"qwen2.5": "qwen2.5:0.5b", "qwen3": "qwen3:0.6b", "llama3.2": "llama3.2:1b",
                 "gemma3": "gemma3:270m"}

# GGUF quantization tags as llama.cpp names them (Q4_K_M, IQ3_XXS, Q8_0, F16, BF16...).
_QUANT = re.compile(r"(?i)^(?:i?q\d(?:_[0-9a-z]+)*|f16|bf16|f32)$")
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")


def is_quant_tag(tag: str) -> bool:
    return bool(_QUANT.match(tag))


@dataclass(frozen=True)
class ModelRef:
    """What a name points to: a repo, and the GGUF tag (None: the repo's default model)."""

    name: str  # as the user wrote it
    repo_id: str | None  # None: the packaged model
    quant: str | None = None

    @property
    def packaged(self) -> bool:
        return self.repo_id is None

    @property
    def canonical(self) -> str:
        if self.repo_id is None:
            return PACKAGED
        return f"{self.repo_id}:{self.quant}" if self.quant else self.repo_id


def _alias(base: str, quant: str | None, name: str) -> ModelRef:
    alias = ALIASES[DEFAULT_SIZES.get(base, base)]
    return ModelRef(name, alias.repo_id, (quant or alias.quant).upper())


def parse_name(name: str) -> ModelRef:
    """`smollm2`, `qwen3`, `qwen3:0.6b`, `qwen3:0.6b-q4_0`, `smollm2:Q8_0`, `org/repo`,
    `org/repo:Q4_K_M`. Raises ModelNameError for anything else."""
    text = name.strip()
    if text == PACKAGED:
        return ModelRef(name, None)
    if text in ALIASES or text in DEFAULT_SIZES:
        return _alias(text, None, name)
    base, sep, tag = text.rpartition(":")
    if sep and "/" in base:
        if not _REPO.match(base) or not is_quant_tag(tag):
            raise ModelNameError(f"bad model name {name!r}: expected org/repo or org/repo:QUANT "
                                 "(a GGUF quantization such as Q8_0 or Q4_K_M)")
        return ModelRef(name, base, tag.upper())
    if _REPO.match(text):
        return ModelRef(name, text)
    if sep and (base in DEFAULT_SIZES or base == PACKAGED) and is_quant_tag(tag):
        return _alias(f"{PACKAGED}:135m" if base == PACKAGED else base, tag, name)
    head, dash, quant = text.rpartition("-")
    if dash and (head in ALIASES or head in DEFAULT_SIZES) and is_quant_tag(quant):
        return _alias(head, quant, name)
    known = ", ".join([PACKAGED, *ALIASES])
    raise ModelNameError(f"unknown model {name!r}: not a path, not org/repo[:QUANT], and not "
                         f"one of the names Loom knows ({known})")
