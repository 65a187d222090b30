"""Routing decisions without servers: affinity blocks, the cache-aware choice and its load
balance, forgetting a replica that went down, round robin."""

from __future__ import annotations

from loom.router.backends import Backend, parse_load
from loom.router.policy import CacheAware, RoundRobin, block_hashes, prompt_text

SYSTEM = "You are a careful assistant. " * 10  # 290 characters: 4 blocks of 64


def _chat(system: str, user: str) -> dict:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": [{"type": "text", "text": user}]}]}


def test_prompt_text_and_blocks() -> None:
    assert prompt_text(_chat("S", "hi")) == "<|system|>S<|user|>hi"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"prompt": 5}) == ""
    a = block_hashes(prompt_text(_chat(SYSTEM, "question one " * 20)), 64)
    b = block_hashes(prompt_text(_chat(SYSTEM, "another question " * 20)), 64)
    shared = sum(1 for x, y in zip(a, b) if x == y)
    assert shared == 4 and a[4] != b[4]  # chained: equal up to the first differing block
    assert block_hashes("short", 64) == block_hashes("short", 64) != block_hashes("shorter", 64)
    assert block_hashes("", 64) == []


def test_cache_aware_follows_the_prefix_until_its_replica_is_overloaded() -> None:
    backends = [Backend("http://a", healthy=True), Backend("http://b", healthy=True)]
    policy = CacheAware(abs_threshold=4, rel_threshold=1.5)
    first = block_hashes(prompt_text(_chat(SYSTEM, "one " * 40)), 64)
    home, matched = policy.choose(backends, first)
    assert matched == 0
    other = next(b for b in backends if b is not home)
    for user in ["two " * 40, "three " * 40]:  # same system prompt: same replica
        chosen, matched = policy.choose(backends, block_hashes(
            prompt_text(_chat(SYSTEM, user)), 64))
        assert chosen is home and matched == 4
    home.in_flight, other.in_flight = 5, 2  # 5 - 2 <= 4: affinity wins
    assert policy.choose(backends, first) == (home, len(first))
    home.in_flight, other.in_flight = 6, 0  # 6 - 0 > 4 and 6 > 1.5 * 0: the least loaded
    assert policy.choose(backends, first) == (other, 0)
    home.in_flight = 0
    home.healthy = True
    home.mark_down("test")  # what it cached is forgotten; `other` holds the system prompt now
    fresh = block_hashes(prompt_text(_chat(SYSTEM, "five " * 40)), 64)
    assert policy.choose(backends, fresh) == (other, 4)


def test_round_robin_alternates_and_load_is_parsed() -> None:
    backends = [Backend("http://a", healthy=True), Backend("http://b", healthy=True)]
    rr = RoundRobin()
    assert [rr.choose(backends, [])[0].url for _ in range(4)] == ["http://a", "http://b"] * 2
    text = ('loom:num_requests_running{model_name="m"} 3.0\n'
            'loom:num_requests_waiting{model_name="m"} 2.0\n')
    assert parse_load(text) == (3.0, 2.0)
    b = Backend("http://c", in_flight=1, running=3, waiting=2)
    assert b.load == 5
