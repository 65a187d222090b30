"""Which files of a Hugging Face repo make a Loom model: a GGUF by tag, or an HF folder."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from pathlib import PurePosixPath

from loom.hub.registry import is_quant_tag

# GGUF tags in the order a repo's default is picked when the name gives none: the block formats
# Loom's loader reads, most precise first.
PREFERRED_QUANTS = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "F16", "BF16", "F32")
# The files of a safetensors checkpoint Loom reads (weights, config, tokenizer, template).
HF_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
               "merges.txt", "chat_template.jinja", "chat_template.json", "*.safetensors",
               "model.safetensors.index.json")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")


class RepoFilesError(ValueError):
    """The repo holds no model Loom can run, or the tag picks none or several files."""


def gguf_tag(filename: str) -> str | None:
    """The quantization tag in a GGUF file name (`SmolLM2-135M-Instruct.Q4_1.gguf` -> Q4_1)."""
    stem = PurePosixPath(filename).name.removesuffix(".gguf")
    for token in reversed(re.split(r"[-.]", _SPLIT.sub("", stem))):
        if is_quant_tag(token):
            return token.upper()
    return None


def _ggufs(files: Iterable[str]) -> list[str]:
    return sorted(f for f in files
                  if f.endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower())


def pick_gguf(files: Iterable[str], quant: str | None, repo_id: str) -> str | None:
    """The GGUF file for `quant` (None: the preferred tag present); None if the repo has no GGUF.
    Raises RepoFilesError when the tag matches no file, or several, or a split model."""
    ggufs = _ggufs(files)
    if not ggufs:
        return None
    tags = {f: gguf_tag(f) for f in ggufs}
    available = sorted({t for t in tags.values() if t})
    if quant is None:
        if len(ggufs) == 1:
            matches = ggufs
        else:
            quant = next((q for q in PREFERRED_QUANTS if q in available), None)
            if quant is None:
                raise RepoFilesError(f"{repo_id} has no GGUF in a format Loom reads "
                                     f"({', '.join(PREFERRED_QUANTS)}); it has {available}")
    if quant is not None:
        matches = [f for f, t in tags.items() if t == quant.upper()]
    if not matches:
        raise RepoFilesError(f"{repo_id} has no GGUF tagged {quant}; its tags: "
                             f"{', '.join(available) or 'none'}")
    if any(_SPLIT.search(f.removesuffix(".gguf")) for f in matches):
        raise RepoFilesError(f"{repo_id}:{quant} is split into several GGUF files "
                             f"({matches[0]}, ...); Loom reads single-file GGUF only")
    if len(matches) > 1:
        raise RepoFilesError(f"{repo_id}:{quant} matches several files: {', '.join(matches)}")
    return matches[0]


def hf_files(files: Iterable[str]) -> list[str]:
    """The files of an HF-format checkpoint Loom needs (top level only)."""
    return sorted(f for f in files
                  if "/" not in f and any(fnmatch.fnmatch(f, p) for p in HF_PATTERNS))


def model_files(files: Iterable[str], quant: str | None, repo_id: str) -> tuple[str, list[str]]:
    """("gguf", [file]) or ("hf", [files]) for a repo's file list."""
    files = list(files)
    if quant is None and "config.json" in files:
        wanted = hf_files(files)
        if not any(f.endswith(".safetensors") for f in wanted):
            raise RepoFilesError(f"{repo_id} has a config.json but no .safetensors weights")
        return "hf", wanted
    gguf = pick_gguf(files, quant, repo_id)
    if gguf is None:
        raise RepoFilesError(f"{repo_id} holds neither GGUF files nor a config.json with "
                             "safetensors weights")
    return "gguf", [gguf]
