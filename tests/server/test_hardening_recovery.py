"""A step that poisons the engine (issue 25): while the engine cleans up after a failed step the
server says so (/health and new requests 503), then serves again; if the clean-up fails, the
engine is dead and every answer is 503 rather than garbage. The app in front of the fake engine
of test_async_engine.py, in process."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loom.core.kv_cache_manager import KVCacheIntegrityError
from tests.server.test_async_engine import FakeEngine, _app, _until

pytestmark = pytest.mark.anyio

BODY = {"prompt": [1, 2], "max_tokens": 3}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class SlowRecovery(FakeEngine):
    """Its integrity check (the last part of recovering) waits for `release`; `broken` makes
    it fail instead."""

    def __init__(self) -> None:
        super().__init__()
        self.checking = threading.Event()
        self.release = threading.Event()
        self.broken = False

    def check_integrity(self) -> None:
        self.checking.set()
        self.release.wait(30)
        if self.broken:
            raise KVCacheIntegrityError("KV cache integrity: injected")


async def test_503_while_recovering_then_serving() -> None:
    fake = SlowRecovery()
    engine, client = _app(fake)
    engine.start()
    fake.fail_next_step = True
    failed = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
    await _until(fake.checking.is_set)
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "unavailable_error"
    busy = await client.post("/v1/completions", json=BODY)
    assert busy.status_code == 503 and "recovering" in busy.json()["error"]["message"]
    fake.release.set()
    assert (await failed).status_code == 500
    assert (await client.get("/health")).status_code == 200
    again = await client.post("/v1/completions", json=BODY)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    await engine.shutdown()
    await client.aclose()


async def test_failed_recovery_is_503_for_good() -> None:
    fake = SlowRecovery()
    fake.broken = True
    fake.release.set()
    engine, client = _app(fake)
    engine.start()
    fake.fail_next_step = True
    failed = await client.post("/v1/completions", json=BODY)
    assert failed.status_code in (500, 503)
    await _until(lambda: not engine.is_running)
    assert (await client.get("/health")).status_code == 503
    # 503 "recovering" until the failed integrity check ends the engine thread, then "died"
    deadline = time.monotonic() + 30
    while True:
        after = await client.post("/v1/completions", json=BODY)
        assert after.status_code == 503
        if "died" in after.json()["error"]["message"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert "died" in after.json()["error"]["message"]
    assert (await client.get("/health")).status_code == 503
    await engine.shutdown()
    await client.aclose()
