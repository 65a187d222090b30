"""The router's relay without servers: a stream its replica cuts after the first bytes ends
with an error event in OpenAI's envelope, and the replica is marked down."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from loom.router.app import Router
from loom.router.args import RouterArgs


def test_a_stream_cut_after_its_first_bytes_ends_with_an_error_event() -> None:
    router = Router(RouterArgs(backends=("http://a",)))
    backend = router.pool.backends[0]
    backend.healthy, backend.in_flight = True, 1

    async def rest() -> AsyncIterator[bytes]:
        yield b"data: 2\n\n"
        raise httpx.ReadError("connection reset")

    async def relay() -> list[bytes]:
        resp = httpx.Response(200, content=b"")
        return [c async for c in router._relay(backend, resp, b"data: 1\n\n", rest())]

    out = asyncio.run(relay())
    assert out[:2] == [b"data: 1\n\n", b"data: 2\n\n"] and len(out) == 3
    assert out[2].startswith(b"data: ") and out[2].endswith(b"\n\n")
    assert json.loads(out[2].removeprefix(b"data: ")) == {"error": {
        "message": "the replica failed while streaming (ReadError); the answer is incomplete",
        "type": "server_error", "param": None, "code": "backend_failed"}}
    assert backend.in_flight == 0 and not backend.healthy
    assert router.metrics.registry.get_sample_value(
        "loom_router:stream_failures_total", {"backend": "http://a"}) == 1
