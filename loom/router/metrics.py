"""The router's own Prometheus metrics (`loom_router:` prefix), in a private registry."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loom.router.backends import BackendPool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PoolCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        gauges = [
            ("loom_router:backend_healthy", "1 while the replica passes its health checks",
             lambda b: float(b.healthy)),
            ("loom_router:backend_in_flight", "Requests this router has open on the replica",
             lambda b: float(b.in_flight)),
            ("loom_router:backend_load", "The replica's load as routing sees it",
             lambda b: b.load),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["backend"])
            for b in self.pool.backends:
                g.add_metric([b.url], value(b))
            yield g


class RouterMetrics:
    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        r = self.registry
        self.requests = Counter("loom_router:requests", "Requests answered, by replica and "
                                "HTTP status (replica '' when none could take it)",
                                ["backend", "status"], registry=r)
        self.retries = Counter("loom_router:retries", "Attempts that failed on a replica "
                               "before anything was streamed and were tried elsewhere",
                               ["backend"], registry=r)
        self.stream_failures = Counter("loom_router:stream_failures", "Streams cut because "
                                       "their replica failed after streaming began", ["backend"],
                                       registry=r)
        self.prompt_blocks = Counter("loom_router:prompt_blocks", "Leading prompt blocks of "
                                     "routed requests (affinity blocks)", registry=r)
        self.matched_blocks = Counter("loom_router:matched_blocks", "Of those, blocks the chosen"
                                      " replica was believed to cache", registry=r)
        self.routing = Histogram("loom_router:routing_seconds", "Request in to upstream request "
                                 "sent (parsing, hashing, choosing)", registry=r,
                                 buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
