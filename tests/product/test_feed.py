"""The dashboard feed's series, from the engine's counters (fast: no server)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from loom.engine.async_engine import EngineSnapshot
from loom.entrypoints.openai.metrics import ServerMetrics
from loom.entrypoints.openai.web import Recorder, _Sample


def test_series_are_rates_and_window_means() -> None:
    engine = SimpleNamespace(snapshot=EngineSnapshot(num_running=2, generation_tokens=40))
    metrics = ServerMetrics(lambda: engine.snapshot, "m")
    recorder = Recorder(engine, metrics)  # type: ignore[arg-type]
    metrics.ttft.observe(0.5)
    metrics.ttft.observe(0.25)
    recorder.sample()  # reads the snapshot and the TTFT histogram
    last = recorder.samples[-1]
    assert (last.generation_tokens, last.running, last.ttft_sum, last.ttft_count) == \
        (40, 2, 0.75, 2)
    recorder.samples.clear()
    t0 = time.monotonic() - 10
    for i in range(11):  # 10 s: 30 tokens/s; two first tokens (200 + 400 ms) in the 2nd window
        ttft = (0.0, 0) if i <= 5 else (0.6, 2)
        recorder.samples.append(_Sample(t0 + i, 30 * i, 100 * i, i % 3, 0, 0.5, *ttft))
    s = recorder.series()
    assert s["generation_tps"] == [30.0, 30.0] and s["prompt_tps"] == [100.0, 100.0]
    assert s["ttft_ms"] == [None, 300.0]
    assert s["running"] == [2, 1] and s["kv_cache_usage"] == [0.5, 0.5]
    assert -5.5 < s["t"][0] < -4.5 and s["t"][1] <= 0
