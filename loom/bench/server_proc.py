"""Spawn a server command, time its start-up, sample its memory, stop it.

Start-up is two figures, both from the moment the command is spawned: until `/health` answers
200, and until the first token of a streamed one-token completion arrives. Memory is sampled
(psutil: /proc on Linux) over the server's whole life, summed over the process tree (the
server may fork engine workers): RSS every `sample_interval` seconds, and PSS, which counts
pages shared between those processes once, every PSS_EVERY intervals (reading it walks the
server's page tables).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from loom.bench.runner import root_url

PSS_EVERY = 20  # sample intervals between two PSS readings (5 s at the default 0.25 s)
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and its live descendants (none where it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except _GONE:
        return []


def _tree_sum(pid: int, read: Callable[[psutil.Process], float]) -> float:
    total = 0
    for p in process_tree(pid):
        try:
            total += read(p)
        except _GONE:
            continue
    return total


def tree_rss(pid: int) -> int:
    """RSS in bytes of `pid` and all its descendants (Linux: /proc/PID/statm, the kernel's
    counters, cheap to read); 0 for what cannot be read."""
    return int(_tree_sum(pid, lambda p: p.memory_info().rss))


def tree_pss(pid: int) -> int:
    """PSS in bytes of `pid` and all its descendants (Linux: /proc/PID/smaps_rollup, which walks
    the process's page tables: milliseconds for a large process); 0 for what cannot be read,
    and where the system keeps no PSS (macOS)."""
    return int(_tree_sum(pid, lambda p: getattr(p.memory_full_info(), "pss", 0)))


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system, with reaped children) of `pid` and its live descendants."""
    def cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    return _tree_sum(pid, cpu)


def machine_busy_seconds() -> float:
    """CPU time all processes spent running, summed over cores, since boot: all but idle and
    iowait (Linux's /proc/stat: user nice system irq softirq steal)."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _has_text(obj: Any) -> bool:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    return bool(choices and choices[0].get("text"))


class ServerProcess:
    """`with ServerProcess(cmd, base_url) as s: s.wait_healthy(); s.first_token(model)`."""

    def __init__(
        self, cmd: list[str], base_url: str, env: dict[str, str] | None = None,
        log_path: str | Path | None = None, sample_interval: float = 0.25,
    ) -> None:
        self.cmd = cmd
        self.base_url = root_url(base_url)
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.sample_interval = sample_interval
        self.proc: subprocess.Popen[bytes] | None = None
        self.t_spawn = 0.0
        self.peak_rss = 0
        self.peak_pss = 0
        self._log: IO[bytes] | None = None
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self) -> ServerProcess:
        self._log = open(self.log_path, "wb") if self.log_path else None
        out = self._log if self._log else subprocess.DEVNULL
        env = {**os.environ, **(self.env or {})}
        self.t_spawn = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise ServerStartError(f"cannot start {self.cmd[0]!r}: {e}") from None
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        # RSS every interval; PSS (a page-table walk of the server, on the cores it runs on)
        # every PSS_EVERY intervals: read every 0.25 s, the walk itself slowed a 2-thread server's
        # one-stream decode measurably.
        assert self.proc is not None
        n = 0
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, tree_rss(self.proc.pid))
            if n % PSS_EVERY == 0:
                self.peak_pss = max(self.peak_pss, tree_pss(self.proc.pid))
            n += 1
            self._stop.wait(self.sample_interval)

    def log_tail(self, n: int = 20) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            tail = self.log_tail()
            raise ServerStartError(f"the server exited with code {self.proc.returncode}"
                                   + (f"; its log ends:\n{tail}" if tail else ""))

    def wait_healthy(self, timeout: float = 300.0, poll: float = 0.05) -> float:
        """Seconds from spawn until GET /health answers 200."""
        deadline = self.t_spawn + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.perf_counter() < deadline:
                self._check_alive()
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return time.perf_counter() - self.t_spawn
                except httpx.HTTPError:
                    pass
                time.sleep(poll)
        raise ServerStartError(f"{self.base_url}/health did not answer 200 within {timeout:.0f} s")

    def first_token(self, model: str, timeout: float = 300.0) -> float:
        """Seconds from spawn until the first token of a streamed completion arrives."""
        body: dict[str, Any] = {"model": model, "prompt": "Hello", "max_tokens": 1,
                                "temperature": 0.0, "stream": True}
        self._check_alive()
        url = self.base_url + "/v1/completions"
        with httpx.Client(timeout=timeout, trust_env=False) as client, \
                client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raise ServerStartError(f"first request answered HTTP {resp.status_code}: "
                                       f"{resp.read()[:300]!r}")
            for line in resp.iter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if data and data != "[DONE]" and _has_text(json.loads(data)):
                    return time.perf_counter() - self.t_spawn
        raise ServerStartError("the first request streamed no token")

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after `grace` seconds; its exit code."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                code = self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                code = self.proc.wait()
            except ProcessLookupError:
                code = self.proc.wait()
        elif self.proc is not None:
            code = self.proc.returncode
        if self.proc is not None:
            try:  # workers left in the group after the leader exited
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
