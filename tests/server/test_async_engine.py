"""AsyncEngine on a fake LLMEngine (no model): delivery, abort, errors, recovery, idling.

The last tests put the real FastAPI app in front of the fake engine (in process, via httpx's
ASGI transport) to check that a failed step is a 500 for the requests in it and nothing else.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from loom.core.kv_cache_manager import PrefixCacheStats
from loom.engine import async_engine
from loom.engine.async_engine import (
    HANDOFF_WAIT_S,
    AsyncEngine,
    EngineShutdownError,
    EngineStepError,
    InvalidRequestError,
    QueueFullError,
)
from loom.engine.llm_engine import EngineStats
from loom.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loom.entrypoints.openai.api_server import build_app
from loom.entrypoints.openai.metrics import ServerMetrics
from loom.entrypoints.openai.serving_common import ServerContext
from loom.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class _FakeKVCache:
    num_usable_blocks: int = 64
    block_size: int = 16


@dataclass
class _FakeScheduler:
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 8
    kv_cache_manager: _FakeKVCache = field(default_factory=_FakeKVCache)
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec: None = None  # no speculative decoding


@dataclass
class _Req:
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    aborted: bool = False


class FakeEngine:
    """Emits token 7 once per step per request until max_tokens; can be told to fail a step."""

    def __init__(self) -> None:
        self.requests: dict[str, _Req] = {}
        self.scheduler = _FakeScheduler()
        self.stats = EngineStats()
        self.steps = 0
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.thread_ids: set[int] = set()
        self.to_prefault = 0  # blocks prefault_kv_cache still has to do
        self.to_move = 0  # pieces huge_pages_step still has to do
        self.huge_page_calls = 0
        self.prefault_calls = 0
        self.prefault_delay = 0.0

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0) -> None:
        self.thread_ids.add(threading.get_ident())
        if prompt == []:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        assert params.max_tokens is not None
        self.requests[request_id] = _Req(list(prompt), params.max_tokens)
        self.scheduler.num_waiting = len(self.requests)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.requests:
                self.requests[rid].aborted = True
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_integrity(self) -> None:
        pass

    def prefault_kv_cache(self, max_blocks: int) -> int:
        self.thread_ids.add(threading.get_ident())
        self.prefault_calls += 1
        time.sleep(self.prefault_delay)
        done = min(max_blocks, self.to_prefault)
        self.to_prefault -= done
        return done

    def huge_pages_step(self) -> bool:
        self.thread_ids.add(threading.get_ident())
        self.huge_page_calls += 1
        if not self.to_move:
            return False
        assert not self.to_prefault  # the KV cache's pages first
        self.to_move -= 1
        return True

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        time.sleep(0.002)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outputs = []
        for rid, req in list(self.requests.items()):
            if req.aborted:
                finish = "abort"
                delta: list[int] = []
            else:
                delta = [7]
                req.tokens.append(7)
                finish = "length" if len(req.tokens) >= req.max_tokens else None
            out = CompletionOutput(0, text="x" * len(req.tokens), token_ids=list(req.tokens),
                                   finish_reason=finish, delta_text="x" * len(delta),
                                   delta_token_ids=delta)
            outputs.append(RequestOutput(rid, None, req.prompt, [out], finished=finish is not None,
                                         metrics=RequestMetrics(time.monotonic())))
            if finish is not None:
                del self.requests[rid]
        self.scheduler.num_waiting = 0
        return outputs


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


async def _started(fake: FakeEngine, **kwargs: object) -> AsyncEngine:
    engine = AsyncEngine(fake, **kwargs)  # type: ignore[arg-type]
    engine.start()
    return engine


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until cond() holds or `timeout` seconds pass (however busy the machine)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def test_outputs_in_order_and_off_the_event_loop() -> None:
    fake = FakeEngine()
    engine = await _started(fake)
    outs = [o async for o in engine.generate([1, 2], _params(5), "a")]
    await engine.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert threading.get_ident() not in fake.thread_ids and len(fake.thread_ids) == 1


async def test_each_step_waits_for_the_loop_to_take_the_last_outputs(monkeypatch) -> None:
    """The engine thread starts a step only once the event loop has run the last step's
    deliveries and the consumer they woke (its per-token work happens between steps, not
    during the next one), at most HANDOFF_WAIT_S later; a loop that does not answer costs a
    step that bound, no hang."""
    # the bound a minute while the order is checked: a loaded machine's loop can take longer
    # than the real 2 ms to answer, and the order is what waiting buys, not its bound
    monkeypatch.setattr(async_engine, "HANDOFF_WAIT_S", 60.0)
    fake = FakeEngine()
    got: list[int] = []  # the outputs the consumer has finished with, as each step starts
    seen_at_step: list[int] = []
    step = fake.step

    def recording_step() -> list[RequestOutput]:
        seen_at_step.append(len(got))
        return step()

    fake.step = recording_step  # type: ignore[method-assign]
    engine = await _started(fake)
    async for o in engine.generate([1, 2], _params(6), "a"):
        time.sleep(HANDOFF_WAIT_S / 4)  # the consumer's per-token work, on the loop
        got.append(len(o.outputs[0].token_ids))
    assert got == [1, 2, 3, 4, 5, 6]
    # step k starts after the consumer finished with output k - 1 (without the handoff the
    # engine thread starts it during that work: the sleep releases the GIL)
    assert seen_at_step == [0, 1, 2, 3, 4, 5]
    # a loop blocked (here: this coroutine not yielding) delays the steps, never stops them
    monkeypatch.setattr(async_engine, "HANDOFF_WAIT_S", HANDOFF_WAIT_S)
    stream = engine.generate([1, 2], _params(4), "b")
    first = await stream.__anext__()
    steps = fake.steps
    deadline = time.monotonic() + 60  # the loop is busy: no delivery runs meanwhile
    while fake.steps == steps and time.monotonic() < deadline:
        time.sleep(0.001)
    assert fake.steps > steps  # the engine went on without the loop
    rest = [o async for o in stream]
    await engine.shutdown()
    assert [len(o.outputs[0].token_ids) for o in [first, *rest]] == [1, 2, 3, 4]


async def test_invalid_request_raises_before_streaming() -> None:
    engine = await _started(FakeEngine())
    with pytest.raises(InvalidRequestError) as info:
        await engine.add_request("bad", [], _params(3))
    assert info.value.param == "prompt"
    await engine.shutdown()


async def test_leaving_the_iteration_aborts_the_request() -> None:
    fake = FakeEngine()
    engine = await _started(fake)
    gen = engine.generate([1], _params(10_000), "long")
    async for out in gen:
        if len(out.outputs[0].token_ids) == 3:
            break
    await gen.aclose()
    await _until(lambda: not fake.requests)
    assert fake.aborted == ["long"] and not fake.requests
    await engine.shutdown()


async def test_failed_step_fails_the_batch_and_the_engine_keeps_serving() -> None:
    fake = FakeEngine()
    engine = await _started(fake)
    streams = [await engine.add_request(f"r{i}", [1], _params(10_000)) for i in range(3)]
    await streams[0].__anext__()
    fake.fail_next_step = True
    for stream in streams:
        with pytest.raises(EngineStepError):
            async for _ in stream:
                pass
    assert engine.is_running and not fake.requests
    after = [o async for o in engine.generate([1], _params(2), "after")]
    assert after[-1].finished and after[-1].outputs[0].token_ids == [7, 7]
    await engine.shutdown()


async def test_waiting_queue_limit() -> None:
    fake = FakeEngine()
    engine = await _started(fake, max_waiting_requests=0)
    with pytest.raises(QueueFullError):
        await engine.add_request("x", [1], _params(2))
    await engine.shutdown()


async def test_idle_thread_sleeps_and_shutdown_fails_in_flight() -> None:
    fake = FakeEngine()
    engine = await _started(fake)
    await _until(lambda: fake.prefault_calls >= 1)  # idle: nothing to prefault, then it blocks
    assert fake.steps == 0 and fake.prefault_calls == 1  # no step, no spin without requests
    stream = await engine.add_request("s", [1], _params(10_000))
    await stream.__anext__()
    await engine.shutdown()
    with pytest.raises(EngineShutdownError):
        async for _ in stream:
            pass
    assert not engine.is_running


async def test_idle_thread_prefaults_until_done_or_a_request_comes() -> None:
    """Idle, the engine thread faults in the next KV blocks' pages (a few a call) until there
    are none left, then moves the weights onto huge pages (a piece a call), then sleeps; a
    request that arrives meanwhile stops it after that call."""
    fake = FakeEngine()
    fake.to_prefault, fake.to_move = 9, 4
    engine = await _started(fake)
    await _until(lambda: fake.huge_page_calls >= 5)
    # 2 blocks a call, then one saying 0; then the weights' pieces, one a call, then one saying
    # there is none left
    assert fake.to_prefault == 0 and fake.prefault_calls == 10
    assert fake.to_move == 0 and fake.huge_page_calls == 5
    assert threading.get_ident() not in fake.thread_ids
    fake.to_prefault, fake.prefault_delay = 1000, 0.01  # busy prefaulting when a request comes
    outs = [o async for o in engine.generate([1], _params(3), "a")]  # not 5 s later
    assert outs[-1].finished and 0 < fake.to_prefault
    calls = fake.prefault_calls
    await _until(lambda: fake.prefault_calls > calls)  # idle again: back at it
    assert fake.prefault_calls > calls
    await engine.shutdown()


def _app(fake: FakeEngine) -> tuple[AsyncEngine, httpx.AsyncClient]:
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    ctx = ServerContext(engine=engine, tokenizer=None, model_name="fake",  # type: ignore[arg-type]
                        max_model_len=1024, log_requests=False)
    app = build_app(ctx, ServerMetrics(lambda: engine.snapshot, "fake"))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return engine, client


async def test_http_500_only_for_the_failed_batch() -> None:
    fake = FakeEngine()
    engine, client = _app(fake)
    engine.start()
    body = {"prompt": [1, 2], "max_tokens": 3}
    ok = await client.post("/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    fake.fail_next_step = True
    failed = await client.post("/v1/completions", json=body)
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    again = await client.post("/v1/completions", json=body)
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    assert (await client.get("/health")).status_code == 200
    await engine.shutdown()
    await client.aclose()


async def test_http_stream_failure_is_an_sse_error_event() -> None:
    fake = FakeEngine()
    engine, client = _app(fake)
    engine.start()
    fake.fail_next_step = True
    r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert '"type":"server_error"' in events[-2] and events[-1] == "data: [DONE]"
    await engine.shutdown()
    await client.aclose()
