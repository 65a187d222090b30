"""The load generator: N streamed requests, at most C in flight, optionally at a Poisson rate.

It stops by itself: every request is sent once, each either finishes, fails, or times out
(`request_timeout` bounds every wait on the socket), and the run returns all the records.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from loom.bench import ENDPOINTS
from loom.bench.request import RequestInput, RequestRecord, build_payload, send_request


class BenchError(RuntimeError):
    """The benchmark cannot run: unreachable server, unknown model, bad arguments."""


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # http://host:port, with or without /v1
    model: str
    endpoint: str = "completions"  # or "chat"
    concurrency: int | None = None  # None: no bound
    request_rate: float = math.inf  # requests/s (Poisson arrivals); inf: all at once
    ignore_eos: bool = True
    stream_usage: bool = True  # ask for stream_options.include_usage
    seed: int = 0
    request_timeout: float = 600.0
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"unknown endpoint {self.endpoint!r}; use one of {sorted(ENDPOINTS)}")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchError(f"concurrency must be at least 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise BenchError(f"request rate must be positive, got {self.request_rate}")


@dataclass
class BenchResult:
    records: list[RequestRecord]
    duration: float  # seconds from the first send until the last request ended


def root_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"the base URL must start with http:// or https://, got {base_url!r}")
    return url.removesuffix("/v1")


def _client(
    limit: int, timeout: float, transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must never see loopback benchmark traffic.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), trust_env=False,
        transport=transport,
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )


def server_model(base_url: str, timeout: float = 10.0) -> str:
    """The first model the server lists at /v1/models; BenchError if it cannot be reached."""
    url = root_url(base_url) + "/v1/models"
    try:
        resp = httpx.get(url, timeout=timeout, trust_env=False)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {url}: {e or type(e).__name__}") from None
    if resp.status_code != 200:
        raise BenchError(f"{url} answered HTTP {resp.status_code}; give the model with --model")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{url} lists no model; give the model with --model") from None


def check_reachable(base_url: str, timeout: float = 10.0) -> None:
    """BenchError unless something answers HTTP at the base URL (any status will do)."""
    url = root_url(base_url) + "/v1/models"
    try:
        httpx.get(url, timeout=timeout, trust_env=False)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {url}: {e or type(e).__name__}") from None


def _arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each send: 0 for the first, exponential (Poisson process) after."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return [0.0] + [float(x) for x in rng.exponential(1.0 / rate, size=max(n - 1, 0))]


async def run_benchmark_async(
    cfg: BenchConfig, inputs: Sequence[RequestInput], tokenizer: Any | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BenchResult:
    """Send every input once (at most `cfg.concurrency` at a time); a record for each."""
    url = root_url(cfg.base_url) + ENDPOINTS[cfg.endpoint]
    limit = max(1, min(cfg.concurrency or len(inputs), len(inputs) or 1))
    sem = asyncio.Semaphore(limit)
    bar = tqdm(total=len(inputs), desc="requests", unit="req", disable=cfg.disable_tqdm)
    gaps = _arrival_gaps(len(inputs), cfg.request_rate, cfg.seed)

    async with _client(limit, cfg.request_timeout, transport) as client:
        t0 = time.perf_counter()

        async def one(req: RequestInput) -> RequestRecord:
            async with sem:
                payload = build_payload(cfg.endpoint, cfg.model, req, cfg.ignore_eos,
                                        cfg.stream_usage)
                rec = await send_request(client, url, payload, req, cfg.endpoint, t0)
            bar.update(1)
            return rec

        tasks = []
        for gap, req in zip(gaps, inputs):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    bar.close()
    for rec in records:
        if rec.success and not rec.usage_reported:
            rec.output_tokens = (len(tokenizer.encode(rec.generated_text, add_special_tokens=False))
                                 if tokenizer is not None else len(rec.chunk_times))
    return BenchResult(records, duration)


def run_benchmark(
    cfg: BenchConfig, inputs: Sequence[RequestInput], tokenizer: Any | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BenchResult:
    """Run the load to completion and return every request's record."""
    return asyncio.run(run_benchmark_async(cfg, inputs, tokenizer, transport))
