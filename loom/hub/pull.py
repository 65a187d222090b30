"""`loom pull NAME`: download a model into the Hugging Face cache through huggingface_hub.

huggingface_hub does the transfer: the HEAD for the file's commit and ETag, a progress bar,
and when a connection breaks mid-file a `Range` request that resumes where it stopped.
Loom then checks every downloaded file against the ETag the Hub gave: the SHA-256 of an LFS
file, the git blob SHA-1 of a small one. A mismatch deletes the file and fails the pull.
`HF_ENDPOINT` points it at a mirror; once pulled, a model resolves offline (loom.hub.cache).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path
from typing import TextIO

from loom.hub.cache import packaged_gguf, resolve_cached
from loom.hub.files import RepoFilesError, model_files
from loom.hub.registry import parse_name

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")


class PullError(RuntimeError):
    """The download failed: unreachable Hub, unknown repo or tag, or a corrupt file."""


class ChecksumError(PullError):
    """A downloaded file does not match the checksum the Hub announced."""


def file_digest(path: Path, etag: str) -> tuple[str, str] | None:
    """(algorithm, hex digest) of `path` in the ETag's kind, or None for an ETag of no known kind.

    A 64-hex ETag is an LFS file's SHA-256; a 40-hex one is git's blob id,
    SHA-1 over `blob <size>\\0` followed by the bytes."""
    if _SHA256.match(etag):
        h = hashlib.sha256()
        kind = "sha256"
    elif _SHA1.match(etag):
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
        kind = "git-sha1"
    else:
        return None
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return kind, h.hexdigest()


def verify(pointer: Path) -> None:
    """Check a cached file against its blob name (the ETag); delete it and raise on mismatch."""
    blob = Path(os.path.realpath(pointer))
    digest = file_digest(blob, blob.name)
    if digest is None or digest[1] == blob.name:
        return
    pointer.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    raise ChecksumError(
        f"checksum mismatch for {pointer.name}: {digest[0]} {digest[1]}, the Hub announced "
        f"{blob.name}; the corrupt file was deleted, run `loom pull` again"
    )


def pull(name: str, out: TextIO = sys.stderr, progress: bool = True) -> Path:
    """Download `name` (alias, org/repo or org/repo:QUANT) unless cached; return its local
    path (the GGUF file or the HF folder).
    `progress`: a byte progress bar on `out`, also when it is not a terminal."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    ref = parse_name(name)
    if ref.packaged:
        out.write(f"{name} is packaged with Loom ({packaged_gguf()}); nothing to pull\n")
        return packaged_gguf()
    assert ref.repo_id is not None
    endpoint = constants.ENDPOINT
    if ref.canonical != name:
        out.write(f"{name} -> {ref.canonical}\n")
    start = time.monotonic()
    try:
        info = HfApi().model_info(ref.repo_id)
        kind, files = model_files([s.rfilename for s in info.siblings or []], ref.quant,
                                  ref.repo_id)
        total = 0
        for filename in files:
            out.write(f"pulling {ref.repo_id}/{filename}\n")
            pointer = Path(hf_hub_download(ref.repo_id, filename,
                                           tqdm_class=_progress_bar(out, filename) if progress else None))
            verify(pointer)
            total += pointer.stat().st_size
    except RepoFilesError as e:
        raise PullError(str(e)) from None
    except RepositoryNotFoundError:
        raise PullError(f"{ref.repo_id} is not a model repo on {endpoint} (or it is private "
                        "or gated: set HF_TOKEN)") from None
    except EntryNotFoundError as e:
        raise PullError(f"{ref.repo_id}: a listed file is missing on {endpoint}: {e}") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError):
        raise PullError(f"cannot pull {name}: offline (HF_HUB_OFFLINE is set)") from None
    except HfHubHTTPError as e:
        raise PullError(f"cannot pull {name} from {endpoint}: {e}") from None
    except OSError as e:  # network down, disk full, size mismatch after the retries
        raise PullError(f"cannot pull {name} from {endpoint}: {e}") from None
    except Exception as e:  # httpx errors the Hub client lets through (connection refused)
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore"):
            raise
        raise PullError(f"cannot reach {endpoint} to pull {name}: {e}") from None
    _, path = resolve_cached(name)
    out.write(f"pulled {ref.canonical}: {len(files)} file(s), {total / 1e6:.1f} MB in "
              f"{time.monotonic() - start:.1f} s -> {path}\n")
    return path


def _progress_bar(out: TextIO, filename: str) -> type:
    """huggingface_hub's tqdm draws only on a terminal; this one draws on `out` always (every
    second where `out` is not a terminal, so a log keeps a few lines)."""
    from huggingface_hub.utils import tqdm

    tty = out.isatty()

    class Progress(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.update(disable=False, file=out, mininterval=0.1 if tty else 1.0, desc=filename)
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

    return Progress
