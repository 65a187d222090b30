"""A tiny random Llama with SmolLM2's tokenizer (fast `loom serve` replicas), `loom router`
subprocesses, and a workload of conversations sharing system prompts."""

from __future__ import annotations

import functools
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

from tests.server.utils import ROOT, ServerProcess, free_port

# Small KV caches and a thread each: several replicas share the machine's cores.
REPLICA_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", str(64 * 2**20),
                "--num-threads", "1", "--dtype", "float32"]


@functools.lru_cache(maxsize=1)
def tiny_chat_model() -> str:
    """A random 2-layer Llama over SmolLM2's full vocabulary, its tokenizer and template."""
    from tests.tiny_models import make_tiny_chat_model

    folder = Path(tempfile.mkdtemp(prefix="loom-router-model-")) / "tiny-chat"
    return str(make_tiny_chat_model("llama", folder, vocab_size=49152,
                                    max_position_embeddings=2048))


class RouterProcess(ServerProcess):
    """`loom router` over `backends` (ServerProcess's start-up, health wait and stop)."""

    def __init__(self, backends: list[str], *args: str) -> None:
        super().__init__(list(args))
        self.backends = backends

    def start(self, wait_healthy: bool = True) -> RouterProcess:
        cmd = [sys.executable, "-m", "loom.entrypoints.cli", "router", "--port",
               str(self.port), "--health-check-interval", "0.5", *self.args]
        for b in self.backends:
            cmd += ["--backend", b]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self._answers(wait_healthy), 60, "router up", self)
        return self

    def _answers(self, healthy: bool) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
        try:
            status = httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return False
        return status == 200 or (not healthy and status == 503)

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=300, max_retries=0)


def wait_for(cond, timeout: float, what: str, proc: ServerProcess | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout} s" + (f"\n{proc.log()}" if proc else ""))


def hit_counts(servers: list[ServerProcess]) -> tuple[float, float]:
    """(prefix-cache hit tokens, looked-up tokens) summed over the replicas' /metrics."""
    hits = queries = 0.0
    for s in servers:
        m = s.metrics()
        hits += m["loom:prefix_cache_hits_total"]
        queries += m["loom:prefix_cache_queries_total"]
    return hits, queries


def conversations(seed: int, num_systems: int, convs_per_system: int) -> list[list[dict]]:
    """Chats as message lists: each system prompt (~150 tokens of random words) opens
    `convs_per_system` conversations; the words differ with `seed`."""
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "cloud", "maple", "orbit", "lantern", "copper", "violet",
             "harbor", "meadow", "signal", "ember", "glacier", "willow", "quartz"]
    chats = []
    for s in range(num_systems):
        system = f"System {seed}-{s}: " + " ".join(rng.choice(words) for _ in range(120))
        chats += [[{"role": "system", "content": system}] for _ in range(convs_per_system)]
    return chats


def run_workload(client: OpenAI, model: str, chats: list[list[dict]], turns: int,
                 seed: int, max_tokens: int = 8) -> None:
    """`turns` rounds; each round every chat (in a shuffled order) sends a user turn and keeps
    the answer, so later turns extend earlier prompts."""
    rng = random.Random(seed)
    for t in range(turns):
        order = list(range(len(chats)))
        rng.shuffle(order)
        for i in order:
            chats[i].append({"role": "user", "content": f"Question {t} of chat {i}: "
                             + " ".join(rng.choice("abcdefgh") for _ in range(30))})
            r = client.chat.completions.create(model=model, messages=chats[i],
                                               max_tokens=max_tokens, temperature=0)
            chats[i].append({"role": "assistant", "content": r.choices[0].message.content})


def replica(model: str, *extra: str) -> ServerProcess:
    return ServerProcess([model, *REPLICA_ARGS, *extra])


__all__ = ["free_port", "hit_counts", "replica", "run_workload", "tiny_chat_model", "wait_for"]
