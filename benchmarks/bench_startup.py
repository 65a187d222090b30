"""Start-up and memory of `loom serve MODEL` (no flags unless --loom-args): seconds from spawn
until /health answers, until the first streamed token, and the peak RSS of the server's process
tree (sampled every --interval s, as benchmarks/compare.py does) over start-up, the first token
and a short burst of --burst concurrent requests; and the CPU seconds the server's tree used until
/health (less skewed than wall time on a shared machine). One line per run, with the load.

    .venv/bin/python benchmarks/bench_startup.py --model FILE.gguf [--runs 3] [--burst 16]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loom.bench.runner import server_model
from loom.bench.server_proc import ServerProcess, tree_cpu_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, median_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _burst(url: str, model: str, n: int, tokens: int) -> None:
    body = {"model": model, "prompt": "The history of the city of Paris begins " * 12,
            "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}

    def one(_: int) -> None:
        with httpx.Client(timeout=300, trust_env=False) as c:
            c.post(url + "/v1/completions", json=body).raise_for_status()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def run_once(ns: argparse.Namespace, log: Path) -> dict[str, float]:
    port = free_port()
    cmd = [str(ROOT / ".venv/bin/loom"), "serve", *([ns.model] if ns.model else []),
           "--port", str(port), *shlex.split(ns.loom_args)]
    url = f"http://127.0.0.1:{port}"
    with ServerProcess(cmd, url, log_path=log, sample_interval=ns.interval) as server:
        health = server.wait_healthy(ns.timeout)
        assert server.proc is not None
        cpu_health = tree_cpu_seconds(server.proc.pid)  # less skewed by other load than wall time
        rss_health = server.peak_rss
        model = server_model(url)
        first = server.first_token(model, ns.timeout)
        if ns.burst:
            _burst(url, model, ns.burst, ns.tokens)
        time.sleep(2 * ns.interval)
    return {"health_s": health, "cpu_s_at_health": cpu_health, "first_token_s": first,
            "rss_at_health_mib": rss_health / 2**20,
            "peak_rss_mib": server.peak_rss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="GGUF file or folder (default: Loom's default)")
    p.add_argument("--loom-args", default="", help="extra flags for loom serve")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--burst", type=int, default=16, help="concurrent requests after start-up")
    p.add_argument("--tokens", type=int, default=16, help="output tokens per burst request")
    p.add_argument("--interval", type=float, default=0.1, help="RSS sampling interval (s)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--log", default="/tmp/bench_startup.log")
    ns = p.parse_args()
    runs = []
    for i in range(ns.runs):
        load = os.getloadavg()[0]
        r = run_once(ns, Path(ns.log))
        runs.append(r)
        print(f"run {i}: load {load:.2f}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()),
              flush=True)
    if ns.runs > 1:
        print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in median_of(runs).items()))


if __name__ == "__main__":
    main()
