"""Small network helpers shared by the processes Loom starts (replicas, distributed ranks)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` nothing listens on now, for a server about to start there (another
    process may take it first: callers that can, retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
