"""Which replica takes a request.

Prefix-cache affinity without a tokenizer: the prompt's text (a completion's prompt, or the
chat messages' roles and contents in order) is cut into blocks of `block_chars` characters,
and each block gets a chained hash (the hash of the block and of every block before it), as a
replica's prefix cache hashes token blocks. The router remembers, per replica, the block hashes
of the prompts it sent there (bounded, least recently used out). The request goes to the
replica holding the longest run of its leading blocks; when none holds even the first block,
to the replica a consistent (rendezvous) hash of the first block picks, so a new shared prefix
lands on one replica and stays there. Either choice gives way to the least loaded replica when
the chosen one is overloaded: load above the least by more than `abs_threshold` and more than
`rel_threshold` times it (SGLang's cache-aware router's balance rule).

Text blocks only approximate token blocks: the same text always gives the same blocks, and a
chat rendered by the replica's template starts with the same messages, which is all affinity
needs. Token-id prompts hash their ids as text.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import xxhash

from loom.router.backends import Backend

MAX_BLOCKS = 512  # leading blocks looked at per prompt (32k characters at 64 per block)
TABLE_SIZE = 200_000  # block hashes remembered per replica


def prompt_text(body: dict[str, Any]) -> str:
    """The text whose leading part decides affinity; "" when the body has none."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text in order
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"<|{m.get('role')}|>{content or ''}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # one prompt of token ids
            return " ".join(map(str, prompt))
        prompt = first if isinstance(first, str) else " ".join(map(str, first))
    return prompt if isinstance(prompt, str) else ""


def block_hashes(text: str, block_chars: int) -> list[int]:
    """Chained hashes of the text's full blocks (of its only block when shorter than one)."""
    n = min(len(text) // block_chars, MAX_BLOCKS)
    if n == 0:
        return [xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass"))] if text else []
    hashes, parent = [], 0
    for i in range(n):
        h = xxhash.xxh64()
        h.update(parent.to_bytes(8, "little"))
        h.update(text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass"))
        parent = h.intdigest()
        hashes.append(parent)
    return hashes


class Policy:
    name = "policy"

    def choose(self, backends: list[Backend], hashes: list[int]) -> tuple[Backend, int]:
        """The replica for a request, and how many of its leading blocks that replica is
        believed to hold. `backends`: the healthy candidates, never empty."""
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, backends: list[Backend], hashes: list[int]) -> tuple[Backend, int]:
        return backends[next(self._counter) % len(backends)], 0


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, backends: list[Backend], hashes: list[int]) -> tuple[Backend, int]:
        return min(backends, key=lambda b: b.load), 0


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, abs_threshold: float, rel_threshold: float) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        # url -> (the replica's generation when the table began, its block hashes)
        self._tables: dict[str, tuple[int, OrderedDict[int, None]]] = {}

    def _table(self, backend: Backend) -> OrderedDict[int, None]:
        """What the replica is believed to cache; emptied when it has been down since."""
        generation, table = self._tables.get(backend.url, (-1, None))
        if table is None or generation != backend.generation:
            table = OrderedDict()
            self._tables[backend.url] = (backend.generation, table)
        return table

    def _matched(self, backend: Backend, hashes: list[int]) -> int:
        table = self._table(backend)
        n = 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n

    def choose(self, backends: list[Backend], hashes: list[int]) -> tuple[Backend, int]:
        matched = {b.url: self._matched(b, hashes) for b in backends}
        best = max(backends, key=lambda b: (matched[b.url], -b.load))
        if matched[best.url] == 0 and hashes:  # a new prefix: a stable home for it
            best = max(backends, key=lambda b: xxhash.xxh64_intdigest(f"{b.url}|{hashes[0]}"
                                                                      .encode()))
        least = min(backends, key=lambda b: b.load)
        if (best.load - least.load > self.abs_threshold
                and best.load > self.rel_threshold * least.load):
            best = least
        self._remember(best, hashes)
        return best, matched[best.url]

    def _remember(self, backend: Backend, hashes: list[int]) -> None:
        table = self._table(backend)
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > TABLE_SIZE:
            table.popitem(last=False)


def make_policy(name: str, abs_threshold: float = 4, rel_threshold: float = 1.5) -> Policy:
    if name == "cache_aware":
        return CacheAware(abs_threshold, rel_threshold)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown routing policy {name!r}")
