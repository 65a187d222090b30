"""Tokenizer and chat template, from an HF folder or from a GGUF file's own metadata.

Tokenization is the `tokenizers` library's; chat templates are rendered by `transformers`' own
renderer; Loom never uses `transformers` modeling code. A GGUF tokenizer is converted once and
cached as an ordinary tokenizer folder, so later starts skip the conversion.

Start-up: a folder whose `tokenizer_config.json` names the generic class (`TokenizersBackend` /
`PreTrainedTokenizerFast`, as Loom's GGUF cache does) and sets no add-BOS/EOS flags is loaded
straight from `tokenizer.json`, without building a `transformers` tokenizer (about 2 s of imports
and parsing on a 2-core machine); tests check it against `AutoTokenizer` token for token. A GGUF cache
naming a model's own class (`GemmaTokenizer`) is loaded once through `AutoTokenizer`, compared with
tokenizer.json alone (loom.tokenizer.fast_check) and, where they agree, read straight from then on.
Every other folder, and `.hf` when something asks for it, uses `AutoTokenizer` as before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from loom.heap import trim as trim_heap
from loom.loader.resolve import ModelSource
from loom.tokenizer import fast_check

logger = logging.getLogger(__name__)

_GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
# Config keys that make transformers rebuild parts of the tokenizer.json pipeline at load.
_PIPELINE_KEYS = {"add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow"}
# transformers' SPECIAL_TOKENS_ATTRIBUTES: what chat templates see as bos_token, eos_token ...
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
# apply_chat_template options the fast renderer leaves to transformers' tokenizer method.
_HF_ONLY_OPTIONS = {"documents", "return_assistant_tokens_mask",
                    "sanitize_control_tokens", "tokenizer_kwargs", "tokenize"}


class ChatTemplateError(ValueError):
    """The model has no chat template, rendering it failed, or its options do not go together
    (`param`: the request field at fault)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


# Names the renderer sets itself: not for a caller's template variables to replace.
_RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "return_assistant_tokens_mask", "tokenize", "tokenizer_kwargs",
    "sanitize_control_tokens", "conversations", *_SPECIAL_TOKENS,
})


def template_kwargs(add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """apply_chat_template's keyword arguments from vLLM's chat options: the assistant's turn
    opened, or the last message left open (an assistant prefill; not both), and further
    template variables (e.g. Qwen3's `enable_thinking`). ChatTemplateError on a bad mix."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be "
                                "true (set add_generation_prompt to false to continue the last "
                                "message)", "continue_final_message")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_NAMES & extra.keys())
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                "chat_template_kwargs")
    kwargs = {**extra, "add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


def _cache_dir() -> Path:
    root = os.environ.get("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom"
    return Path(root) / "tokenizers"


# the converted files' format: 2 since BPE merges are written as "a b" strings (_compact_merges)
_CACHE_FORMAT = 2


def _gguf_cache_key(path: Path, fmt: int = _CACHE_FORMAT) -> str:
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{fmt}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _drop_older_formats(path: Path) -> None:
    """Remove this file's tokenizer folders of earlier cache formats (Gemma 3's format 1 held
    33 MB), once its current one is written."""
    for fmt in range(1, _CACHE_FORMAT):
        old = _cache_dir() / _gguf_cache_key(path, fmt)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _compact_merges(path: Path) -> None:
    """A converted tokenizer.json's BPE merges [[a, b], ...] rewritten as "a b" strings, the
    other form `tokenizers` reads, where no part holds a space (the same merges): parsed in
    ~0.75x the time, most of a large vocabulary's start-up (Gemma 3's 514,906 merges: 1.14-1.24
    s against 1.40-1.77 s on a 2-core Zen 3). Left as it is otherwise."""
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or not isinstance(merges[0], list):
        return
    if any(len(m) != 2 or " " in m[0] or " " in m[1] for m in merges):
        return
    model["merges"] = [f"{a} {b}" for a, b in merges]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


_MAX_CHARS_FILE = "loom_max_token_chars.json"
ENCODE_IN_PLACE_CHARS = 2048  # up to this, encode holds the GIL for well under 1 ms


def _file_stamp(path: Path) -> list[int] | None:
    """(size, mtime in ns) of `path`: a cached value derived from it holds while they do."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _tokenizer_folder(source: ModelSource) -> Path | None:
    """The folder holding the tokenizer files, or None for a GGUF not yet converted."""
    if source.kind == "hf":
        return source.path
    cached = _cache_dir() / _gguf_cache_key(source.path)
    return cached if (cached / "tokenizer_config.json").exists() else None


# GGUF `general.architecture` -> the `model_type` transformers' GGUF loader gives the config it
# builds for the file (modeling_gguf_pytorch_utils.load_gguf_checkpoint), for the architectures
# Loom runs ("mistral" is left to AutoTokenizer: its Mistral backend choice has more rules).
_GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                     "gemma3": "gemma3_text", "phi3": "phi3", "qwen2moe": "qwen2_moe",
                     "qwen3moe": "qwen3_moe"}


def _gguf_tokenizer_class(path: Path, arch: str | None) -> Any:
    """The tokenizer class AutoTokenizer picks for the GGUF file `path` of architecture `arch`
    alone in its folder, or None to ask AutoTokenizer. AutoTokenizer first builds the model's
    config from the file with the `gguf` package's reader, which parses every metadata value in
    Python: ~30 s of a first start
    for Gemma 3's 262,144-token vocabulary on a 2-core machine, ~8 s for SmolLM2's 49,152. The
    class follows from the architecture alone (the model type's registered tokenizer, else
    the generic backend); the conversion after it is the same call. Tested file for file against
    AutoTokenizer's (tests/model/test_gguf_tokenizer.py)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if any((path.parent / name).exists() for name in ("tokenizer_config.json", "config.json")):
        return None  # Hugging Face files beside it: AutoTokenizer's own rules weigh them
    model_type = _GGUF_MODEL_TYPES.get(arch)
    if model_type is None and arch not in (*GGUF_CONFIG_ARCHS, *GGUF_SUPPORTED_ARCHITECTURES):
        # AutoTokenizer raises on a file whose model config transformers cannot build
        # (Granite, SmolLM3, Mistral 3, OLMo 2, Nemotron-H, ...): its generic backend reads
        # the tokenizer alone
        return TokenizersBackend
    if model_type is None:
        return None
    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    if name is None:
        return TokenizersBackend
    if name.removesuffix("Fast") in ("TokenizersBackend", "PreTrainedTokenizer"):
        return None  # not seen for these architectures: let AutoTokenizer decide
    return tokenizer_class_from_name(name)


def _load_hf_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(source)
    if folder is not None:
        return AutoTokenizer.from_pretrained(str(folder))
    cached = _cache_dir() / _gguf_cache_key(source.path)
    logger.info("converting the GGUF tokenizer of %s (once; cached in %s)", source.path, cached)
    from loom.loader.gguf_file import read_gguf

    arch = read_gguf(source.path).get("general.architecture")
    cls = _gguf_tokenizer_class(source.path, arch) or AutoTokenizer
    tok = cls.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    if not getattr(tok, "chat_template", None):
        from loom.tokenizer.templates import builtin_template

        tok.chat_template = builtin_template(arch)
        if tok.chat_template is not None:
            logger.info("%s carries no chat template; using %s's turn format", source.path, arch)
    try:
        tok.save_pretrained(str(cached))
        if (cached / "tokenizer.json").is_file():
            _compact_merges(cached / "tokenizer.json")
        _drop_older_formats(source.path)
    except OSError as e:  # a read-only home must not stop serving
        logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_fast(folder: Path, checked: bool = False
               ) -> tuple[Any, dict[str, str], str | None] | None:
    """(tokenizers.Tokenizer, special tokens map, chat template) read straight from the folder's
    files, or None when the folder needs transformers' own loading (see the module docstring).
    `checked`: a model's own class too (fast_check found it adds nothing to tokenizer.json)."""
    config_path, json_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_path.is_file() and json_path.is_file()):
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if not checked and (config.get("tokenizer_class") not in _GENERIC_CLASSES
                        or _PIPELINE_KEYS & config.keys()):
        return None
    if config.get("clean_up_tokenization_spaces"):  # transformers post-edits decoded text
        return None
    template = config.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        return None  # named templates (a list): transformers picks one per request
    from tokenizers import Tokenizer as RawTokenizer

    backend = RawTokenizer.from_file(str(json_path))
    special = {name: text for name in _SPECIAL_TOKENS
               if (text := _token_text(config.get(name))) is not None}
    return backend, special, template


class Tokenizer:
    """Encode, decode and render chat templates for one model."""

    def __init__(
        self,
        hf_tokenizer: Any = None,
        eos_token_ids: tuple[int, ...] = (),
        *,
        backend: Any = None,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        source: ModelSource | None = None,
    ) -> None:
        """Either a transformers tokenizer, or a raw `tokenizers.Tokenizer` (`backend`) with its
        special tokens and chat template; `source` lets `.hf` load the former on demand."""
        self._hf = hf_tokenizer
        self._source = source
        if hf_tokenizer is not None:
            backend = hf_tokenizer.backend_tokenizer
            special_tokens = dict(hf_tokenizer.special_tokens_map)
            chat_template = getattr(hf_tokenizer, "chat_template", None)
        assert backend is not None, "a transformers tokenizer or a tokenizers backend is needed"
        self.backend = backend  # the raw `tokenizers.Tokenizer`
        self.special_tokens: dict[str, str] = special_tokens or {}
        self._chat_template = chat_template
        self.eos_token_ids: tuple[int, ...] = ()
        self.set_model_eos_token_ids(eos_token_ids)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def set_model_eos_token_ids(self, eos_token_ids: tuple[int, ...]) -> Tokenizer:
        """The stop tokens: the model config's `eos_token_ids`, then the tokenizer's eos token
        (for an engine that reads the tokenizer before the model); returns self."""
        ids = list(eos_token_ids)
        eos = self.special_tokens.get("eos_token")
        eos_id = None if eos is None else self.backend.token_to_id(eos)
        if eos_id is not None:
            ids.append(eos_id)
        self.eos_token_ids = tuple(dict.fromkeys(ids))
        return self

    @staticmethod
    def is_ready(source: ModelSource) -> bool:
        """Whether loading reads a tokenizer folder (an HF folder, or a GGUF's converted one
        already cached), rather than converting the GGUF's own."""
        return _tokenizer_folder(source) is not None

    @classmethod
    def from_source(cls, source: ModelSource, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        folder = _tokenizer_folder(source)
        gguf = source.kind == "gguf"  # the folder is Loom's cache
        checked = fast_check.verdict(folder) if gguf and folder is not None else None
        fast = None if folder is None else _load_fast(folder, checked=bool(checked))
        if fast is None:
            hf = _load_hf_tokenizer(source)
            folder = _tokenizer_folder(source)  # again: a GGUF's tokenizer may be cached just now
            if gguf and folder is not None and checked is None:
                # a GGUF cache Loom wrote: once, see whether tokenizer.json alone will do
                raw = _load_fast(folder, checked=True)
                if raw is not None:
                    fast_check.mark(folder, raw, hf)
            tok = cls(hf, eos_token_ids, source=source)
        else:
            backend, special, template = fast
            tok = cls(None, eos_token_ids, backend=backend, special_tokens=special,
                      chat_template=template, source=source)
        trim_heap()  # parsing a big tokenizer.json leaves hundreds of MB free in the heap
        return tok

    @property
    def hf(self) -> Any:
        """The `transformers` tokenizer, loaded on first use when the fast path was taken. Once
        loaded it is authoritative: chat templates (incl. one assigned to it) render through it."""
        if self._hf is None:
            if self._source is None:
                raise RuntimeError("this Tokenizer was built without a source for transformers")
            self._hf = _load_hf_tokenizer(self._source)
        return self._hf

    @property
    def hf_loaded(self) -> bool:
        """Whether the `transformers` tokenizer is loaded (False: the fast path alone)."""
        return self._hf is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt
        # tokenized on a worker thread leaves the event loop and the engine thread running.
        # A short one is encoded in place: encode_batch hands it to the tokenizers' thread pool
        # and waits for it, a wake-up that costs more than the work (same ids either way).
        if len(text) <= ENCODE_IN_PLACE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest entry
        of the vocabulary (a byte-level token's characters are its bytes). Kept beside a GGUF's
        converted tokenizer in Loom's cache: listing Gemma 3's 262k-token vocabulary took
        ~0.3-0.5 s of every start."""
        folder = None
        if self._source is not None and self._source.kind == "gguf":
            folder = _tokenizer_folder(self._source)
        if folder is None:
            return self._longest_token()
        path, stamp = folder / _MAX_CHARS_FILE, _file_stamp(folder / "tokenizer.json")
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("tokenizer.json") == stamp and isinstance(saved.get("chars"), int):
                return saved["chars"]
        except (OSError, ValueError, AttributeError):
            pass
        chars = self._longest_token()
        try:
            path.write_text(json.dumps({"tokenizer.json": stamp, "chars": chars}),
                            encoding="utf-8")
        except OSError:
            pass  # a read-only cache: computed again next start
        return chars

    def _longest_token(self) -> int:
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=0)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._hf is not None:  # it may clean up tokenization spaces
            return self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(int(t)) for t in token_ids]

    @property
    def chat_template(self) -> str | None:
        if self._hf is not None:
            return getattr(self._hf, "chat_template", None)
        return self._chat_template

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
            if self._hf is not None or _HF_ONLY_OPTIONS & template_kwargs.keys():
                return self.hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template, tools=tools, **template_kwargs,
                )
            return self._render(messages, add_generation_prompt, chat_template, tools,
                                template_kwargs)
        except Exception as e:  # jinja errors (raise_exception in templates) reach users as 400s
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        chat_template: str | None, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any],
    ) -> str:
        """What `apply_chat_template(tokenize=False)` does for one conversation, through
        transformers' own renderer (its module, without building a transformers tokenizer)."""
        from transformers.utils.chat_template_utils import (
            _normalize_chat_messages,
            render_jinja_template,
        )

        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(messages)], tools=tools,
            chat_template=chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs},
        )
        return rendered[0]

    def encode_chat(self, messages: list[dict[str, Any]], add_special_tokens: bool = False,
                    **kwargs: Any) -> list[int]:
        # The template already contains any BOS token (add_special_tokens: another on top).
        return self.encode(self.apply_chat_template(messages, **kwargs),
                           add_special_tokens=add_special_tokens)
