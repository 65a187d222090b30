"""A `loom serve` subprocess on a free loopback port (llama.cpp tests/utils.py ServerProcess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loom.net import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = float(os.environ.get("LOOM_TEST_SERVER_START_TIMEOUT", "600"))
# The servers' logs (a failing test's message quotes its server's), removed when the run ends.
_LOGS = tempfile.TemporaryDirectory(prefix="loom-serve-logs-")

# Small limits keep the KV cache (and so the server's memory) small on a CI machine. The tests
# compare a request's tokens across batches (alone, concurrent, offline): batch-invariant kernels.
ENGINE_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", str(256 * 2**20),
               "--batch-invariant"]


class ServerProcess:
    """Start with `start()`, talk to `url`, stop with `stop()`; the log is kept for failures."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="loom-serve-", suffix=".log",
                                              dir=_LOGS.name)[1])

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "loom.entrypoints.cli", "serve", "--port", str(self.port),
               *self.args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"server not healthy after {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if not self.alive:
            return
        self.signal(signal.SIGTERM)
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels dropped; histograms by sample name)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "le" in sample.labels:
                    continue
                samples[sample.name] = sample.value
        return samples

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and the KV cache is empty."""
        deadline = time.monotonic() + timeout
        m = self.metrics()
        while time.monotonic() < deadline:
            if (m["loom:num_requests_running"] == 0 and m["loom:num_requests_waiting"] == 0
                    and m["loom:kv_cache_usage_perc"] == 0):
                return m
            time.sleep(0.2)
            m = self.metrics()
        raise AssertionError(f"server not idle after {timeout} s: {m}")
