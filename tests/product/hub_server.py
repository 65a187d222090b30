"""A local server in the Hugging Face Hub's URL layout, for `loom pull` under HF_ENDPOINT.

What huggingface_hub 2.4 asks for, and what this answers:
- GET /api/models/ORG/REPO[/revision/REV]: model_info, `sha` and `siblings`;
- HEAD /ORG/REPO/resolve/REV/FILE: X-Repo-Commit, ETag (git blob SHA-1) and, for LFS files,
  X-Linked-Etag (the SHA-256) and X-Linked-Size;
- GET of the same URL, honouring `Range: bytes=N-` with 206 and Content-Range (the resume).
Faults on demand: `cut_once` sends half of a file's first GET and drops the connection;
`stall_once` sends part of it and hangs (the client is then killed);
`corrupt` serves bytes that do not match the announced checksum. `requests` logs every request.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class RepoFile:
    path: Path  # the bytes served
    lfs: bool
    sha256: str = ""
    git_sha1: str = ""

    def __post_init__(self) -> None:
        data_hash = hashlib.sha256()
        git = hashlib.sha1(f"blob {self.path.stat().st_size}\0".encode())
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                data_hash.update(chunk)
                git.update(chunk)
        self.sha256, self.git_sha1 = data_hash.hexdigest(), git.hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, dict[str, RepoFile]]
    cut_once: set[str] = field(default_factory=set)  # "repo/file" whose first GET breaks
    corrupt: set[str] = field(default_factory=set)  # "repo/file" served with a flipped byte
    # "repo/file" -> bytes: the first GET sends that many, then hangs until `release` is set
    stall_once: dict[str, int] = field(default_factory=dict)
    release: threading.Event = field(default_factory=threading.Event)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def gets(self, filename: str) -> list[str | None]:
        """The Range header of every GET of `filename` (None: a whole-file GET)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + filename)]


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        return

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = self.path.split("?")[0]
        self.hub.requests.append((self.command, path, self.headers.get("Range")))
        if path.startswith("/api/models/"):
            return self._model_info(path.removeprefix("/api/models/"), body)
        org, _, rest = path.lstrip("/").partition("/")
        name, _, rest = rest.partition("/resolve/")
        _rev, _, filename = rest.partition("/")
        repo_id = f"{org}/{name}"
        files = self.hub.repos.get(repo_id)
        if files is None:
            return self._error(404, "RepoNotFound", f"repository {repo_id} not found")
        f = files.get(filename)
        if f is None:
            return self._error(404, "EntryNotFound", f"{filename} not in {repo_id}")
        self._file(f"{repo_id}/{filename}", f, body)

    def _model_info(self, rest: str, body: bool) -> None:
        repo_id = "/".join(rest.split("/")[:2])
        files = self.hub.repos.get(repo_id)
        if files is None:
            return self._error(404, "RepoNotFound", f"repository {repo_id} not found")
        data = json.dumps({"id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": False,
                           "siblings": [{"rfilename": n} for n in files]}).encode()
        self._send(200, {"Content-Type": "application/json"}, data if body else b"", len(data))

    def _file(self, key: str, f: RepoFile, body: bool) -> None:
        size = f.path.stat().st_size
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{f.git_sha1}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if f.lfs:
            headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(size)})
        start = 0
        rng = self.headers.get("Range")
        status = 200
        if rng and rng.startswith("bytes=") and body:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        if not body:
            return self._send(200, headers, b"", size)
        data = f.path.read_bytes()[start:]
        if key in self.hub.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        if key in self.hub.stall_once and start == 0:
            sent = self.hub.stall_once.pop(key)
            self._send(status, headers, data[:sent], len(data))
            self.hub.release.wait(120)
            self.close_connection = True
            return
        if key in self.hub.cut_once and start == 0:
            self.hub.cut_once.discard(key)
            self._send(status, headers, data[: len(data) // 2], len(data))
            self.close_connection = True
            self.connection.shutdown(2)  # the peer sees the body end early
            return
        self._send(status, headers, data, len(data))

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self._send(status, {"X-Error-Code": code, "X-Error-Message": message,
                            "Content-Type": "application/json"}, data, len(data))

    def _send(self, status: int, headers: dict[str, str], data: bytes, length: int) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if data and self.command != "HEAD":
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
