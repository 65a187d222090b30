"""The replicas behind the router: health, load, and the checks that keep both current.

A replica is healthy after its /health answered 200 and until a check or a proxied request
fails to reach it. Its load is the larger of the router's own in-flight count for it (exact
for traffic through this router, updated at once) and running + waiting from its /metrics
(also counts traffic that bypasses the router, but only as fresh as the last check).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0


@dataclass
class Backend:
    url: str
    healthy: bool = False
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    generation: int = 0  # bumped whenever it goes down: its cache content is then unknown

    @property
    def load(self) -> float:
        return max(float(self.in_flight), self.running + self.waiting)

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            logger.warning("replica %s is down: %s", self.url, reason)
        self.healthy = False
        self.generation += 1


def parse_load(metrics_text: str) -> tuple[float, float]:
    """(running, waiting) from a replica's Prometheus text."""
    running = waiting = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "loom:num_requests_running":
                running += sample.value
            elif sample.name == "loom:num_requests_waiting":
                waiting += sample.value
    return running, waiting


class BackendPool:
    """The replicas and a task that checks each of them every `interval` seconds."""

    def __init__(self, urls: tuple[str, ...], interval: float) -> None:
        if not urls:
            raise ValueError("the router needs at least one --backend URL")
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=CHECK_TIMEOUT_S)
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client is not None:
            await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))

    async def check(self, backend: Backend) -> None:
        assert self._client is not None
        try:
            health = await self._client.get(f"{backend.url}/health")
            if health.status_code != 200:
                backend.mark_down(f"/health answered {health.status_code}")
                return
            metrics = await self._client.get(f"{backend.url}/metrics")
            backend.running, backend.waiting = parse_load(metrics.text)
        except (httpx.HTTPError, ValueError) as e:
            backend.mark_down(f"{type(e).__name__}: {e}")
            return
        if not backend.healthy:
            logger.info("replica %s is up", backend.url)
        backend.healthy = True
