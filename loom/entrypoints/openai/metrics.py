"""Prometheus metrics for /metrics, in vLLM's naming style (`loom:` prefix).

Gauges and counters are read at scrape time from the engine's latest `EngineSnapshot` (the
engine keeps the totals; nothing here double-counts). Histograms are observed on the engine
thread from each RequestOutput's `RequestMetrics`: inter-token latency at every step that
produced tokens, the others once when the request finishes. A private CollectorRegistry keeps
tests and several servers in one process apart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from loom.engine.async_engine import EngineSnapshot
    from loom.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0, 20.0)


class _EngineCollector(Collector):
    """Gauges and counters from the engine snapshot, labelled with the model name."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        gauges = [
            ("loom:num_requests_running", "Requests in the running batch", s.num_running),
            ("loom:num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
            ("loom:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)",
             s.kv_cache_usage),
            ("loom:max_waiting_requests", "Waiting requests beyond which new ones get 429",
             s.max_waiting_requests),
        ]
        counters = [  # CounterMetricFamily adds the `_total` suffix
            ("loom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             s.prefix_cache_queries),
            ("loom:prefix_cache_hits", "Prompt tokens found in the prefix cache",
             s.prefix_cache_hits),
            ("loom:num_preemptions", "Requests preempted (for lack of KV blocks, or by priority)",
             s.num_preemptions),
            ("loom:prompt_tokens", "Prompt tokens received", s.prompt_tokens),
            ("loom:generation_tokens", "Tokens generated", s.generation_tokens),
            ("loom:num_requests_rejected", "Requests answered 429 (waiting queue full)",
             s.num_rejected),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model_name], value)
            yield g
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model_name], value)
            yield c
        if s.spec_decode is not None:
            yield from _spec_decode_metrics(s.spec_decode, self._model_name)


def _spec_decode_metrics(st, model_name: str) -> Iterator[Metric]:
    """Speculative decoding (vLLM's names): drafts, draft and accepted tokens, both per draft
    position (acceptance rate at position i = accepted_per_pos / draft_tokens_per_pos)."""
    for name, doc, value in (
        ("loom:spec_decode_num_drafts", "Speculative drafts verified", st.num_drafts),
        ("loom:spec_decode_num_draft_tokens", "Draft tokens proposed", st.num_draft_tokens),
        ("loom:spec_decode_num_accepted_tokens", "Draft tokens accepted",
         st.num_accepted_tokens),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model_name], value)
        yield c
    for name, doc, values in (
        ("loom:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position",
         st.accepted_per_pos),
        ("loom:spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed, by position",
         st.proposed_per_pos),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name", "position"])
        for pos, value in enumerate(values):
            c.add_metric([model_name, str(pos)], value)
        yield c
    g = GaugeMetricFamily("loom:spec_decode_acceptance_rate",
                          "Draft tokens accepted / proposed since start", labels=["model_name"])
    g.add_metric([model_name], st.acceptance_rate)
    yield g


class ServerMetrics:
    """The server's registry; `observe` is the AsyncEngine's `on_output` hook."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labelnames=["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("loom:time_to_first_token_seconds",
                              "Arrival to first generated token", _LATENCY_BUCKETS)
        self.itl = histogram("loom:inter_token_latency_seconds",
                             "Time between consecutive token steps of a request", _ITL_BUCKETS)
        self.e2e = histogram("loom:e2e_request_latency_seconds",
                             "Arrival to finish (any finish reason)", _LATENCY_BUCKETS)
        self.queue_time = histogram("loom:request_queue_time_seconds",
                                    "Arrival to first scheduled", _LATENCY_BUCKETS)
        self._last_token_time: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, output: RequestOutput) -> None:
        """Record one output's timings (engine thread)."""
        m = output.metrics
        if m is None:
            return
        rid = output.request_id
        with self._lock:
            if m.last_token_time is not None:
                previous = self._last_token_time.get(rid)
                if previous is not None and m.last_token_time > previous:
                    self.itl.observe(m.last_token_time - previous)
                self._last_token_time[rid] = m.last_token_time
            if not output.finished:
                return
            self._last_token_time.pop(rid, None)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def ttft_totals(self) -> tuple[float, float]:
        """The time-to-first-token histogram's (sum of seconds, count) since start."""
        samples = self.ttft.collect()[0].samples
        total = {x.name.rpartition("_")[2]: x.value for x in samples}
        return total["sum"], total["count"]

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
