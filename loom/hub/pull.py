"""`loom pull NAME`: download a model into the Hugging Face cache through huggingface_hub.

huggingface_hub does the talking: the repo's file list (`model_info`), each file's commit, ETag
and size (`get_hf_file_metadata`, a HEAD), and the transfer (`http_get`: a progress bar, and a
`Range` request that resumes when a connection breaks mid-file). Loom keeps the part already
downloaded as `blobs/ETAG.incomplete`, so a pull stopped by Ctrl-C, a crash or a network down for
longer than huggingface_hub's retries resumes where it stopped the next time (huggingface_hub
2.4's own `hf_hub_download` throws a partial file away). Before a file enters the cache it is
checked against the ETag: the SHA-256 of an LFS file, the git blob SHA-1 of a small one; a
mismatch deletes it and fails the pull. The cache layout is huggingface_hub's own
(`models--ORG--REPO/{refs/main, blobs/ETAG, snapshots/COMMIT/FILE -> blob}`), so everything that
reads the HF cache reads it. `HF_ENDPOINT` points at a mirror; once pulled, a model resolves
offline (loom.hub.cache).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path
from typing import TextIO

from loom.hub.cache import packaged_gguf, repo_folder, resolve_cached
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


def fetch(repo_id: str, filename: str, out: TextIO, progress: bool) -> Path:
    """One file of `main` into the cache (resuming a part left by an earlier pull); returns its
    snapshot path. Raises ChecksumError, or huggingface_hub's and httpx's errors."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    meta = get_hf_file_metadata(hf_hub_url(repo_id, filename))
    if not meta.etag or not meta.commit_hash:
        raise PullError(f"{repo_id}/{filename}: the Hub sent no ETag or commit")
    folder = repo_folder(repo_id)
    blob = folder / "blobs" / meta.etag
    pointer = folder / "snapshots" / meta.commit_hash / filename
    for d in (blob.parent, pointer.parent, folder / "refs", folder / ".locks"):
        d.mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(meta.commit_hash)
    with WeakFileLock(folder / ".locks" / f"{meta.etag}.lock"):
        if not blob.exists():
            part = blob.with_name(blob.name + ".incomplete")
            with open(part, "ab") as f:
                done = f.tell()
                if done:
                    out.write(f"resuming {filename} at {done / 1e6:.1f} MB\n")
                if meta.size is None or done < meta.size:
                    # the token goes to the Hub only, not to the CDN an LFS file redirects to
                    hub = meta.location.startswith(constants.ENDPOINT)
                    http_get(meta.location, f, resume_size=done,
                             headers=build_hf_headers() if hub else None,
                             expected_size=meta.size,
                             displayed_filename=filename,
                             tqdm_class=_progress_bar(out, filename) if progress else _quiet_bar())
            _check(part, meta.etag, filename)
            os.replace(part, blob)
        if not pointer.exists():
            pointer.unlink(missing_ok=True)  # a link to a blob since deleted
            os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    return pointer


def _check(part: Path, etag: str, filename: str) -> None:
    digest = file_digest(part, etag)
    if digest is not None and digest[1] != etag:
        part.unlink(missing_ok=True)
        raise ChecksumError(
            f"checksum mismatch for {filename}: {digest[0]} {digest[1]}, the Hub announced "
            f"{etag}; the corrupt download was deleted, run `loom pull` again")


def pull(name: str, out: TextIO = sys.stderr, progress: bool = True) -> Path:
    """Download `name` (alias, org/repo or org/repo:QUANT) unless cached; return its local
    path (the GGUF file or the HF folder).
    `progress`: a byte progress bar on `out`, also when it is not a terminal."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        EntryNotFoundError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError,
    )

    ref = parse_name(name)
    if ref.packaged:
        out.write(f"{name} is packaged with Loom ({packaged_gguf()}); nothing to pull\n")
        return packaged_gguf()
    assert ref.repo_id is not None
    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        raise PullError(f"cannot pull {name}: offline (HF_HUB_OFFLINE is set)")
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
            total += fetch(ref.repo_id, filename, out, progress).stat().st_size
    except RepoFilesError as e:
        raise PullError(str(e)) from None
    except RepositoryNotFoundError:
        raise PullError(f"{ref.repo_id} is not a model repo on {endpoint} (or it is private "
                        "or gated: set HF_TOKEN)") from None
    except EntryNotFoundError as e:
        raise PullError(f"{ref.repo_id}: a listed file is missing on {endpoint}: {e}") from None
    except OfflineModeIsEnabled:
        raise PullError(f"cannot pull {name}: offline (HF_HUB_OFFLINE is set)") from None
    except HfHubHTTPError as e:
        raise PullError(f"cannot pull {name} from {endpoint}: {e}") from None
    except OSError as e:  # disk full, size mismatch after the retries
        raise PullError(f"cannot pull {name} from {endpoint}: {e}") from None
    except Exception as e:  # httpx errors the Hub client lets through (connection refused)
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore"):
            raise
        raise PullError(f"cannot reach {endpoint} to pull {name}: {e}; run `loom pull` again "
                        "to resume") from None
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
            kwargs.update(disable=False, file=out, mininterval=0.1 if tty else 1.0,
                          desc=filename)
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

    return Progress


def _quiet_bar() -> type:
    from huggingface_hub.utils import tqdm

    class Quiet(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.update(disable=True)
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

    return Quiet
