"""Soak: many mixed requests against one `loom serve`, reporting lost requests and memory.

A request is *lost* when it gets a 5xx, hangs past --timeout, breaks off without its end
(a stream without `[DONE]`, a body that is not the answer's shape), or a bad request is not
answered 400-class in OpenAI's error envelope. 429 (queue full) counts as shed, not lost.
Kinds, drawn at random with a fixed seed: streams, whole completions, chats, constrained
outputs (choice, regex, JSON schema), client disconnects mid-stream, and bad requests (the
hardening table: lone surrogates, deep nesting, 64-bit overflows, grammars past the grammar
engine's limits, oversized prompts, malformed JSON). The server's RSS (process tree) is
sampled over the run; at the end the server must be idle with an empty KV cache.

    python benchmarks/soak.py --requests 10000 --concurrency 16          # starts loom serve
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234      # an existing server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import dump, free_port  # noqa: E402

from loom.bench.server_proc import ServerProcess, tree_rss  # noqa: E402

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
DEEP = "[" * 5000 + "]" * 5000
BAD: list[tuple[str, Any]] = [
    (CMPL, {"prompt": "x\ud800y", "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "user", "content": "x\udfffy"}]}),
    (CMPL, {"prompt": "hi", "guided_json": DEEP}),
    (CMPL, {"prompt": "hi", "seed": 2**64}),
    (CMPL, {"prompt": "hi", "guided_regex": "((a{100}){100}){100}"}),
    (CMPL, {"prompt": "hi", "guided_choice": [f"o{i}" for i in range(20_000)]}),
    (CMPL, {"prompt": "word " * 400_000, "max_tokens": 2}),
    (CMPL, {"prompt": [1] * 200_000}),
    (CMPL, '{"prompt": "hi",'),
    (CMPL, {"prompt": "hi", "max_tokens": -1}),
]
KINDS = {"stream": 30, "complete": 15, "chat": 15, "constrained": 15, "disconnect": 10,
         "bad": 15}


def _body(rng: random.Random, kind: str) -> tuple[str, Any]:
    prompt = f"Item {rng.randrange(1000)}: tell me about the number {rng.randrange(100)}."
    n = rng.randint(2, 12)
    if kind == "bad":
        return rng.choice(BAD)
    if kind == "chat":
        return CHAT, {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                      "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(2**32)}
    if kind == "constrained":
        constraint = rng.choice([{"guided_choice": ["yes", "no", "maybe"]},
                                 {"guided_regex": "[0-9]{1,4}"},
                                 {"guided_json": {"type": "object", "properties": {
                                     "n": {"type": "integer"}}, "required": ["n"]}}])
        return CMPL, {"prompt": prompt, "max_tokens": 24, **constraint}
    return CMPL, {"prompt": prompt, "max_tokens": n, "temperature": rng.choice([0, 0.7]),
                  "stream": kind in ("stream", "disconnect")}


async def _one(client: httpx.AsyncClient, kind: str, path: str, body: Any,
               timeout: float) -> str:
    """The outcome: ok, shed (429), or lost:<why>."""
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", path, content=content, headers=headers) as r:
                if kind == "disconnect" and r.status_code == 200:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return "ok"  # leave after the first event: the client hangs up
                text = (await r.aread()).decode()
    except TimeoutError:
        return "lost:timeout"
    except httpx.HTTPError as e:
        return f"lost:{type(e).__name__}"
    if r.status_code == 429:
        return "shed"
    if r.status_code >= 500:
        return f"lost:{r.status_code}"
    if kind == "bad":
        ok = 400 <= r.status_code < 500 and set(json.loads(text)["error"]) == {
            "message", "type", "param", "code"}
        return "ok" if ok else f"lost:bad-answered-{r.status_code}"
    if r.status_code != 200:
        return f"lost:{r.status_code}"
    if text.startswith("data:"):
        return "ok" if text.rstrip().endswith("data: [DONE]") and '"error"' not in text \
            else "lost:stream-broken"
    choice = json.loads(text)["choices"][0]
    if kind == "constrained" and "guided_choice" in body and choice["finish_reason"] == "stop":
        return "ok" if choice["text"] in body["guided_choice"] else "lost:constraint"
    return "ok" if choice.get("finish_reason") in ("stop", "length") else "lost:finish"


async def soak(url: str, pid: int | None, requests: int, concurrency: int, timeout: float,
               seed: int, rss_every: float) -> dict[str, Any]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=requests)
    outcomes: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()
    done = 0

    async def sample_rss() -> None:
        while pid is not None:
            rss.append((round(time.monotonic() - t0, 1), tree_rss(pid) // 2**20))
            await asyncio.sleep(rss_every)

    queue: asyncio.Queue[str] = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while not queue.empty():
            kind = queue.get_nowait()
            path, body = _body(rng, kind)
            outcome = await _one(client, kind, path, body, timeout)
            outcomes[outcome] += 1
            by_kind[f"{kind}:{outcome}"] += 1
            done += 1
            if done % max(1, requests // 20) == 0:
                print(f"{done}/{requests} {dict(outcomes)} rss {rss[-1] if rss else '-'}",
                      file=sys.stderr)

    sampler = asyncio.ensure_future(sample_rss())
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    idle = await _wait_idle(url)
    if pid is not None:
        rss.append((round(time.monotonic() - t0, 1), tree_rss(pid) // 2**20))
    sampler.cancel()
    lost = sum(v for k, v in outcomes.items() if k.startswith("lost"))
    return {"requests": requests, "concurrency": concurrency, "seconds": round(
        time.monotonic() - t0, 1), "lost": lost, "outcomes": dict(outcomes),
        "by_kind": dict(sorted(by_kind.items())), "idle_after": idle,
        "rss_mib": {"start": rss[0][1], "peak": max(v for _, v in rss), "end": rss[-1][1],
                    "timeline": [f"{t}s={v}" for t, v in rss[:: max(1, len(rss) // 40)]]}
        if rss else None}


async def _wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """The server's gauges once nothing runs or waits and the KV cache is empty (or at the
    timeout: then the figures show what leaked)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while True:
            gauges = {}
            for line in (await client.get("/metrics")).text.splitlines():
                for name in ("num_requests_running", "num_requests_waiting",
                             "kv_cache_usage_perc"):
                    if line.startswith(f"loom:{name}{{"):
                        gauges[name] = float(line.rsplit(" ", 1)[1])
            if not any(gauges.values()) or time.monotonic() > deadline:
                return gauges
            await asyncio.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an existing server (default: start loom serve)")
    ap.add_argument("--pid", type=int, help="the existing server's pid, for its RSS")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a request "
                    "counts as hung")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-every", type=float, default=1.0)
    ap.add_argument("--port", type=int, default=None,
                    help="the port of the server it starts (default: a free one)")
    ap.add_argument("--out", help="write the JSON report here too")
    ap.add_argument("serve_args", nargs="*", help="extra `loom serve` flags (after --)")
    args = ap.parse_args()
    server = None
    url, pid = args.url, args.pid
    if url is None:
        port = args.port or free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "loom.entrypoints.cli", "serve", "--port", str(port),
               "--disable-log-requests", *args.serve_args]
        server = ServerProcess(cmd, url, log_path="/tmp/loom-soak-server.log").start()
        server.wait_healthy()
        pid = server.proc.pid if server.proc else None
    try:
        report = asyncio.run(soak(url, pid, args.requests, args.concurrency, args.timeout,
                                  args.seed, args.rss_every))
    finally:
        if server is not None:
            report_code = server.stop()
            print(f"server exit code {report_code}", file=sys.stderr)
    dump(args.out, report)


if __name__ == "__main__":
    main()
