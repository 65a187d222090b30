"""The router: prefix-cache hit rate of cache-aware routing against round robin, and the
latency the router adds per request on loopback.

Two `loom serve` replicas (a tiny random Llama with SmolLM2's tokenizer by default, or
--model) and one `loom router` per policy, all subprocesses on free loopback ports (the
helpers of tests/router/utils.py).

- Hit rate: conversations sharing system prompts (--systems prompts, --convs each, --turns
  rounds, the answers kept in the chat) through each policy; the hit rate is the replicas'
  prefix-cache hit tokens over looked-up tokens (their /metrics) during that run. Each policy
  gets its own prompt words, so neither finds the other's blocks.
- Added latency: --latency-requests one-token completions, alternately straight to replica 0
  and through a router that has only replica 0; the added latency is the difference of the
  two distributions' p50 and p99.

    .venv/bin/python benchmarks/bench_router.py --out benchmarks/results/router-<date>.json
    .venv/bin/python benchmarks/bench_router.py --convs 1 --turns 2 --latency-requests 20  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import dump  # noqa: E402
from tests.router.utils import (  # noqa: E402
    RouterProcess, conversations, hit_counts, replica, run_workload, tiny_chat_model,
)


def hit_rates(urls: list[str], replicas, args) -> dict[str, float]:
    rates = {}
    for seed, policy in enumerate(["round_robin", "cache_aware"]):
        router = RouterProcess(urls, "--policy", policy).start()
        try:
            client = router.client()
            model = client.models.list().data[0].id
            before = hit_counts(replicas)
            run_workload(client, model, conversations(seed, args.systems, args.convs),
                         args.turns, seed)
            after = hit_counts(replicas)
            rates[policy] = (after[0] - before[0]) / max(1.0, after[1] - before[1])
        finally:
            router.stop()
    return rates


def added_latency(replica0, n: int) -> dict[str, float]:
    router = RouterProcess([replica0.url]).start()
    try:
        clients = {"direct": replica0, "router": router}
        times: dict[str, list[float]] = {"direct": [], "router": []}
        import httpx

        with httpx.Client(timeout=60) as http:
            model = http.get(f"{replica0.url}/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            for i in range(n + 5):
                for name, proc in clients.items():
                    t0 = time.perf_counter()
                    r = http.post(f"{proc.url}/v1/completions", json=body)
                    dt = time.perf_counter() - t0
                    r.raise_for_status()
                    if i >= 5:  # warm-up
                        times[name].append(dt)
    finally:
        router.stop()
    out = {}
    for q, label in [(50, "p50"), (99, "p99")]:  # numpy's interpolation, as `loom bench`'s
        d, r = np.percentile(times["direct"], q), np.percentile(times["router"], q)
        out[f"direct_{label}_ms"] = float(1e3 * d)
        out[f"router_{label}_ms"] = float(1e3 * r)
        out[f"added_{label}_ms"] = float(1e3 * (r - d))
    out["added_mean_ms"] = 1e3 * (statistics.fmean(times["router"])
                                  - statistics.fmean(times["direct"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: a tiny random Llama")
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--convs", type=int, default=3, help="conversations per system prompt")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--latency-requests", type=int, default=200)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    model = args.model or tiny_chat_model()
    replicas = [replica(model).start() for _ in range(2)]
    try:
        result = {"model": args.model or "tiny random llama (SmolLM2 tokenizer)",
                  "workload": {"systems": args.systems, "convs": args.convs,
                               "turns": args.turns},
                  "hit_rate": hit_rates([r.url for r in replicas], replicas, args),
                  "latency": added_latency(replicas[0], args.latency_requests)}
    finally:
        for r in replicas:
            r.stop()
    dump(args.out, result)


if __name__ == "__main__":
    main()
