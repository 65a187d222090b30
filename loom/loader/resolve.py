"""Turn what a user typed (path, repo id, nothing) into a local model source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loom.hub import ModelNameError, ModelNotPulledError, packaged_gguf, resolve_cached
from loom.hub.registry import PACKAGED as DEFAULT_MODEL


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local file or folder, nor in the local Hugging Face cache."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: Path  # the .gguf file, or the HF folder
    name: str  # what the user asked for (served model name by default)


def default_gguf_path() -> Path:
    try:
        return packaged_gguf()
    except ModelNotPulledError as e:
        raise ModelNotFoundError(str(e)) from None


def resolve_model(model: str | None) -> ModelSource:
    """A `.gguf` path, an HF folder, None/"smollm2", or a model name pulled into the local HF
    cache (an alias such as `qwen3:0.6b`, `org/repo` or `org/repo:Q8_0`; see loom.hub)."""
    if model is None or model == DEFAULT_MODEL:
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelSource("gguf", path, model)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], model)
        return ModelSource("hf", path, model)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a .gguf file nor a model folder")
    try:  # a name: alias, org/repo or org/repo:QUANT, pulled before (`loom pull`)
        kind, found = resolve_cached(model)
    except (ModelNameError, ModelNotPulledError) as e:
        raise ModelNotFoundError(str(e)) from None
    return ModelSource(kind, found, model)
