"""Helpers shared by the offline benchmarks: run a function in a fresh process, measure it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
from collections.abc import Callable
from typing import Any


def _child(fn: Callable[..., dict[str, Any]], args: tuple, queue: mp.Queue) -> None:
    result = fn(*args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put(result)


def in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any,
                     env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run fn(*args) in a new process so load time and peak memory are its own; `env` is added
    to its environment (read before it imports anything, e.g. OpenMP's settings)."""
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        proc.start()  # the child copies the environment here
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    result = queue.get()
    proc.join()
    return result


def free_port() -> int:
    """A loopback port nothing listens on now, for a server this script starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def machine() -> dict[str, Any]:
    import torch  # here, not at the top: scripts that only dump JSON need not load it

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def dump(path: str | None, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
