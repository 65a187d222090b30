"""Whether a GGUF tokenizer cache whose `tokenizer_config.json` names a model's own class
(`GemmaTokenizer` ...) can still take the fast path (tokenizer.json alone, no transformers).

Loom writes those folders itself (the converted tokenizer, saved once). Where transformers'
class adds nothing tokenizer.json does not already hold (the usual case: transformers 5 saves its
whole pipeline there), reading tokenizer.json alone gives the same tokens; building the class
instead costs seconds (Gemma 3's 262k-token vocabulary: ~4 s of Python on a 2-core machine).
So once, after a slow load, the two are compared on probe texts, special tokens and the chat
template; a marker file records the verdict against the files it was checked on, and later
starts read tokenizer.json straight. A folder that differs in anything keeps transformers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "loom_fast_path.json"
PROBES = [
    "The capital of France is", "", " ", "  leading and trailing  ", "\n\n\tTabs\r\n",
    "café naïve 日本語 😀 👨‍👩‍👧 🇫🇷 e\u0301", "def f(x):\n    return x ** 2  # comment",
    "1234567890 3.14159", "a" * 300, "Ġ weird Ċ bytes \x00\x01", "ab  cd   ef\u00a0gh",
]


def _fingerprint(folder: Path) -> str:
    """What the verdict is about: the config's bytes, tokenizer.json's size and mtime, the chat
    template's bytes, and the transformers release whose class was compared (another may build
    the class differently)."""
    h = hashlib.sha256((folder / "tokenizer_config.json").read_bytes())
    st = (folder / "tokenizer.json").stat()
    h.update(f"{st.st_size}:{st.st_mtime_ns}:{importlib.metadata.version('transformers')}".encode())
    template = folder / "chat_template.jinja"
    if template.is_file():
        h.update(template.read_bytes())
    return h.hexdigest()


def verdict(folder: Path) -> bool | None:
    """The marker's verdict on `folder` (True: the fast path gives transformers' tokens), or
    None where there is none for its present files."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        if marker.get("fingerprint") == _fingerprint(folder):
            return marker.get("fast") is True
    except (OSError, ValueError, AttributeError):
        pass
    return None


def same_tokens(backend: Any, special: dict[str, str], template: str | None, hf: Any) -> str | None:
    """Why the raw tokenizer (`backend`, `special`, `template`) differs from transformers' `hf`,
    or None where they agree on every probe."""
    if getattr(hf, "clean_up_tokenization_spaces", False):
        return "transformers cleans up tokenization spaces"
    if special != dict(hf.special_tokens_map):
        return "special tokens differ"
    if template != getattr(hf, "chat_template", None):
        return "chat templates differ"
    vocab = backend.get_vocab_size(with_added_tokens=True)
    if vocab != len(hf):
        return "vocabulary sizes differ"
    texts = PROBES + [f"{t}{text}" for t in special.values() for text in ("x", " y")]
    for text in texts:
        for add in (True, False):
            ids = backend.encode(text, add_special_tokens=add).ids
            if ids != hf.encode(text, add_special_tokens=add):
                return f"encodings of {text!r} differ"
    ids = list(range(0, vocab, max(vocab // 997, 1)))
    for skip in (True, False):
        if backend.decode(ids, skip_special_tokens=skip) != hf.decode(ids,
                                                                       skip_special_tokens=skip):
            return "decodings differ"
    return None


def mark(folder: Path, fast: tuple[Any, dict[str, str], str | None], hf: Any) -> bool:
    """Compare and write the marker (either verdict); True where the fast path may be taken."""
    why = same_tokens(*fast, hf)
    try:
        (folder / MARKER).write_text(json.dumps(
            {"fast": why is None, "why_not": why, "fingerprint": _fingerprint(folder)}))
    except OSError as e:  # a read-only cache: the next start compares again
        logger.debug("could not write %s: %s", folder / MARKER, e)
    if why is None:
        logger.info("the cached tokenizer in %s reads from tokenizer.json alone from now on "
                    "(checked against transformers' %s)", folder, type(hf).__name__)
    return why is None
