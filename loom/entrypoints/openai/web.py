"""The browser side of `loom serve`: a chat page at `/`, a live engine view at `/dashboard`,
and the dashboard's JSON feed at `/dashboard/feed`.

The pages are static files shipped in the package (`static/`, no build step, no CDN); they talk
to the server's own OpenAI routes. The feed is read from the engine's own numbers: the
`EngineSnapshot` and the latency histograms of `/metrics` (ServerMetrics), sampled once a second
into a ring buffer (the last `HISTORY_S` seconds), plus the scheduler's requests as they stand.
The pages and the feed need no API key (like /metrics): the feed holds counts and request ids,
never prompt or output text; the chat page sends the key the user types with each request.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

if TYPE_CHECKING:
    from loom.engine.async_engine import AsyncEngine
    from loom.entrypoints.openai.metrics import ServerMetrics

HISTORY_S = 600  # seconds of history the dashboard's charts show
SAMPLE_S = 1.0
SERIES_STEP_S = 5  # one chart point per this many seconds
_ASSETS = {  # URL -> (file in static/, media type); nothing else is served
    "/": ("chat.html", "text/html; charset=utf-8"),
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
FEED = "/dashboard/feed"
OPEN_PATHS = frozenset({*_ASSETS, FEED})  # served without the API key
# No inline script, no other origin: a reply that slipped past the escaping could not run.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True, slots=True)
class _Sample:
    t: float  # time.monotonic()
    generation_tokens: int
    prompt_tokens: int
    running: int
    waiting: int
    kv_cache_usage: float
    ttft_sum: float
    ttft_count: float


class Recorder:
    """Samples the engine's counters once a second; answers the feed from the ring buffer."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.samples: deque[_Sample] = deque(maxlen=int(HISTORY_S / SAMPLE_S) + 1)
        self.started = time.monotonic()

    def sample(self) -> None:
        s = self.engine.snapshot
        ttft_sum, ttft_count = self.metrics.ttft_totals()
        self.samples.append(_Sample(time.monotonic(), s.generation_tokens, s.prompt_tokens,
                                    s.num_running, s.num_waiting, s.kv_cache_usage, ttft_sum,
                                    ttft_count))

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_S)

    def series(self) -> dict[str, list[float | None]]:
        """Per SERIES_STEP_S window: tokens/s, mean TTFT of the requests that got their first
        token in it, and the gauges at its end. `t` is seconds before now (negative)."""
        points = list(self.samples)[::-1][::int(SERIES_STEP_S / SAMPLE_S)][::-1]
        out: dict[str, list[float | None]] = {k: [] for k in (
            "t", "generation_tps", "prompt_tps", "ttft_ms", "running", "waiting",
            "kv_cache_usage")}
        now = time.monotonic()
        for a, b in zip(points, points[1:]):
            dt = b.t - a.t
            n = b.ttft_count - a.ttft_count
            out["t"].append(round(b.t - now, 1))
            out["generation_tps"].append(round((b.generation_tokens - a.generation_tokens) / dt, 2))
            out["prompt_tps"].append(round((b.prompt_tokens - a.prompt_tokens) / dt, 2))
            out["ttft_ms"].append(round(1000 * (b.ttft_sum - a.ttft_sum) / n, 1) if n else None)
            out["running"].append(b.running)
            out["waiting"].append(b.waiting)
            out["kv_cache_usage"].append(round(b.kv_cache_usage, 4))
        return out


def _requests(engine: AsyncEngine) -> list[dict[str, object]]:
    """The scheduler's requests as they stand. Read from the event loop while the engine thread
    runs: list() of a dict is one step under the GIL, each field read is a plain int, so a row
    may be a step stale but is never torn."""
    now = time.monotonic()
    rows = []
    parents = engine.engine.parents
    for r in list(engine.engine.scheduler.requests.values()):
        parent = parents.get(r.request_id.split("#")[0])
        first = parent.metrics.first_token_time if parent is not None else None
        rows.append({
            "id": r.request_id, "state": r.status.name.lower(),
            "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
            "computed_tokens": r.num_computed_tokens, "max_tokens": r.max_tokens,
            "age_s": round(now - r.arrival_time, 2),
            "ttft_ms": None if first is None else round(1000 * (first - r.arrival_time), 1),
        })
    rows.sort(key=lambda row: -float(row["age_s"]))  # type: ignore[arg-type]
    return rows


def _feed(app: FastAPI) -> dict[str, object]:
    ctx, recorder = app.state.loom, app.state.recorder
    s = ctx.engine.snapshot
    llm = ctx.engine.engine
    return {
        "model": ctx.model_name,
        "uptime_s": round(time.monotonic() - recorder.started, 1),
        "now": {
            "running": s.num_running, "waiting": s.num_waiting,
            "kv_cache_usage": round(s.kv_cache_usage, 4),
            "prefix_cache_hit_rate": round(s.prefix_cache_hits / s.prefix_cache_queries, 4)
            if s.prefix_cache_queries else None,
            "prompt_tokens_total": s.prompt_tokens, "generation_tokens_total": s.generation_tokens,
            "preemptions": s.num_preemptions,
        },
        "kv_cache": {"num_blocks": llm.num_blocks,
                     "block_size": llm.scheduler.block_size,
                     "max_model_len": ctx.max_model_len},
        "series": recorder.series(),
        "requests": _requests(ctx.engine),
    }


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Merged into the app's lifespan by include_router (after the engine started)."""
    app.state.recorder = Recorder(app.state.loom.engine, app.state.metrics)
    task = asyncio.create_task(app.state.recorder.run())
    try:
        yield
    finally:
        task.cancel()


router = APIRouter(lifespan=_lifespan)


def _asset(path: str) -> Response:
    filename, media_type = _ASSETS[path]
    body = resources.files("loom.entrypoints.openai").joinpath("static", filename).read_bytes()
    return Response(body, media_type=media_type, headers=_HEADERS)


def _endpoint(path: str):  # noqa: ANN202 - a route handler without parameters
    async def endpoint() -> Response:
        return _asset(path)

    return endpoint


for _path in _ASSETS:
    router.add_api_route(_path, _endpoint(_path), methods=["GET", "HEAD"],
                         include_in_schema=False)


@router.get(FEED, include_in_schema=False)
async def dashboard_feed(request: Request) -> JSONResponse:
    """The dashboard's data: gauges now, series over the last minutes, each request's state."""
    return JSONResponse(_feed(request.app), headers={"Cache-Control": "no-store"})
