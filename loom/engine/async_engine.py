"""AsyncEngine: the synchronous LLMEngine behind an asyncio interface, for the HTTP server.

Threads (the only two that touch engine state):
- the event loop thread calls `add_request` / `abort` / `abort_all`; each becomes a command on a
  thread-safe queue and never touches the LLMEngine itself;
- the engine thread owns the LLMEngine: it drains commands, runs `step()` while any request is
  unfinished, and when there is nothing to do faults in the KV-cache pages the next requests
  will write (until a command arrives), then blocks on the command queue (no polling).
Outputs go back to one asyncio queue per request through `loop.call_soon_threadsafe`, one
callback per step. `docs/serving.md` explains why this is a thread and not a process.

Invariants:
- a request id is in `_streams` from a successful add until its finished output (or an error)
  has been handed to its stream; only the engine thread reads or writes `_streams`;
- every stream receives exactly one terminal item: a finished RequestOutput or an exception.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loom.request import CONSTRAINT_FAILED
from loom.engine.llm_engine import InvalidRequestError

if TYPE_CHECKING:
    from loom.core.spec_decode import SpecDecodeStats
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.outputs import RequestOutput
    from loom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngine", "EngineDeadError", "EngineShutdownError", "EngineSnapshot", "EngineStepError",
    "InvalidRequestError", "QueueFullError", "RequestFailedError", "RequestStream",
    "default_max_waiting_requests",
]


# The longest the engine thread waits after a step for the event loop to take its outputs
# (AsyncEngine._step): a loop busy elsewhere costs a step no more than this. Only on the CPU
# (on a GPU the loop's work overlaps the device's instead) and for steps of a few streams (with
# many, the loop's work a step would reach the bound, and each stream's share of a step is small).
HANDOFF_WAIT_S = 0.002
HANDOFF_MAX_STREAMS = 4


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight at that moment was dropped."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or it could not recover from a failed step)."""


class EngineShutdownError(RuntimeError):
    """The request was aborted because the server is shutting down."""


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting_requests` requests."""

    retry_after = 1  # seconds a client should wait before retrying (HTTP Retry-After)


class RequestFailedError(RuntimeError):
    """This request alone failed in the engine (the others of its step went on).

    `invalid`: its own input caused it (an output constraint that failed mid-generation),
    a client error; otherwise an internal error of this request."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.invalid = message.startswith(CONSTRAINT_FAILED)


def default_max_waiting_requests(max_num_seqs: int, kv_tokens: int) -> int:
    """The waiting-queue bound when none is given: two full batches, where a batch is
    max_num_seqs requests or as many 256-token requests as the KV cache holds, if more."""
    return 2 * max(max_num_seqs, kv_tokens // 256, 1)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine gauges and counters, published by the engine thread after every iteration."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    max_waiting_requests: int = 0
    num_rejected: int = 0  # requests answered "busy" (429) since start
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters, when on


class RequestStream:
    """The outputs of one request, in order; ends after the finished output or an exception."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop side of a delivery from the engine thread."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    done: asyncio.Future[None]
    prompt_token_ids: list[int] | None = None
    check_queue: bool = True  # False for the later prompts of one HTTP request
    priority: int = 0  # the priority scheduling policy's rank


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    error: BaseException | None = None  # None: the stream gets the "abort" output


@dataclass(slots=True)
class _AbortAll:
    error: BaseException


class _Stop:
    pass


_Command = _Add | _Abort | _AbortAll | _Stop


class AsyncEngine:
    """Runs an LLMEngine on a dedicated thread; `add_request` / `generate` from asyncio code.

    `on_output` (optional) is called on the engine thread with every RequestOutput, before
    delivery; the server observes its latency histograms there.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.engine = engine
        if max_waiting_requests is None:
            kv = engine.scheduler.kv_cache_manager
            max_waiting_requests = default_max_waiting_requests(
                engine.scheduler.max_num_seqs, kv.num_usable_blocks * kv.block_size)
        self.max_waiting_requests = max_waiting_requests
        self.on_output = on_output
        self.snapshot = EngineSnapshot(max_waiting_requests=max_waiting_requests)
        self._num_rejected = 0
        self._recovering = False  # a failed step is being cleaned up: not serving (503)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._handed = threading.Event()  # the loop has run a step's deliveries (_step)
        device = getattr(getattr(engine, "runner", None), "device", None)
        self._handoff = getattr(device, "type", "cpu") == "cpu"

    # ---- life cycle (event loop thread) ----------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="loom-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Fail whatever is still in flight with EngineShutdownError and stop the thread."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(thread.join, timeout)
        if thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout)

    @property
    def is_running(self) -> bool:
        """The engine thread serves: started, alive, and not recovering from a failed step."""
        return (self._thread is not None and self._thread.is_alive() and self._dead is None
                and not self._recovering)

    def check_capacity(self, n: int) -> None:
        """Raise QueueFullError if `n` more waiting requests would pass the bound (a cheap
        early answer from the last snapshot; the engine thread checks again exactly)."""
        if self._over_bound(self.snapshot.num_waiting, n):
            self._num_rejected += 1
            raise self._queue_full(self.snapshot.num_waiting)

    def _over_bound(self, waiting: int, n: int) -> bool:
        """`n` more would pass the bound; but an empty queue takes any request, however large
        (it would never find more room), unless the bound is 0 (take nothing)."""
        limit = self.max_waiting_requests
        return waiting + n > limit and (waiting > 0 or limit == 0)

    def _queue_full(self, num_waiting: int) -> QueueFullError:
        return QueueFullError(
            f"the server is busy: {num_waiting} requests are waiting (at most "
            f"{self.max_waiting_requests}, --max-waiting-requests); retry later")

    # ---- requests (event loop thread) ------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        prompt_token_ids: list[int] | None = None, check_queue: bool = True, priority: int = 0,
    ) -> RequestStream:
        """Queue a request and wait until the engine took it.

        Raises InvalidRequestError (bad prompt or parameters), QueueFullError or
        EngineDeadError before any output exists. Iterate the returned stream for outputs;
        call `stream.abort()` if you stop early. `prompt_token_ids`: a text prompt already
        tokenized (so the engine thread does not tokenize it). `check_queue=False`: the
        waiting-queue bound was checked for the whole HTTP request already (its first prompt).
        `priority`: LLMEngine.add_request's.
        """
        if not self.is_running or self._loop is None:
            state = (f"it died: {self._dead}" if self._dead is not None else
                     "recovering from a failed step" if self._recovering else "not started")
            raise EngineDeadError(f"the engine is not running ({state})")
        stream = RequestStream(request_id, self)
        done: asyncio.Future[None] = self._loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, stream, done, prompt_token_ids,
                                check_queue, priority))
        try:
            await done
        except asyncio.CancelledError:  # the caller went away while the add was in flight
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative text plus this step's deltas) until it
        finishes. Stopping the iteration early (break, cancellation) aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; unknown or finished ids are ignored. Safe from any thread."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._commands.put(_Abort(ids))

    def abort_all(self, error: BaseException) -> None:
        """Fail every request in flight with `error` (its stream raises it) and abort them."""
        self._commands.put(_AbortAll(error))

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if idle:
                    self._prefault_while_idle()
                commands = self._next_commands(block=idle)
                if any(isinstance(c, _Stop) for c in commands):
                    self._fail_all(EngineShutdownError("the server is shutting down"))
                    return
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_snapshot()
        except BaseException as e:  # noqa: BLE001 - report any thread death to every waiter
            logger.exception("the engine thread died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine thread died: {e!r}"))
        finally:
            self._drain_after_exit()

    def _prefault_while_idle(self) -> None:
        """Fault in the KV-cache pages the next requests will write, a few blocks at a time,
        then move the weights onto huge pages a piece at a time (short calls), until a command
        arrives or all is done."""
        while self._commands.empty() and (self.engine.prefault_kv_cache(2)
                                          or self.engine.huge_pages_step()):
            pass

    def _next_commands(self, block: bool) -> list[_Command]:
        """All queued commands; with block=True wait (sleeping) for at least one."""
        commands: list[_Command] = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self.engine.abort_request(command.request_ids)
        elif isinstance(command, _AbortAll):
            self._fail_all(command.error)

    def _add(self, command: _Add) -> None:
        error: BaseException | None = None
        if command.check_queue and self._over_bound(self.engine.scheduler.num_waiting,
                                                    command.params.n):
            self._num_rejected += 1
            error = self._queue_full(self.engine.scheduler.num_waiting)
        else:
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        prompt_token_ids=command.prompt_token_ids,
                                        priority=command.priority)
                self._streams[command.request_id] = command.stream
            except InvalidRequestError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - an unexpected failure is this request's 500
                logger.exception("add_request failed for %s", command.request_id)
                error = e
        self._call_soon(_resolve, command.done, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the whole batch failed; keep serving
            logger.exception("engine step failed; failing %d requests", len(self._streams))
            self._recovering = True  # /health and new requests: 503 until it is clean again
            try:
                self._reset(list(self._streams))
                self._recovering = False
            finally:  # clean engine first, so a client that retries finds it serving
                self._fail_all(EngineStepError(f"internal error in the engine step: {e!r}"))
            return
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for output in outputs:
            if self.on_output is not None:
                try:
                    self.on_output(output)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    logger.exception("on_output hook failed")
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            # A request that failed alone ends with its own error; the others are untouched.
            failure = None if output.error is None else RequestFailedError(output.error)
            deliveries.append((stream, output if failure is None else failure))
        if deliveries:
            # Wait (HANDOFF_WAIT_S at most) until the loop has run them and the tasks they
            # woke: the per-token Python of the streams (SSE chunks, socket writes) then runs
            # here, between steps, where the OpenMP worker's core is idle, not inside the next
            # step, where the GIL lets it run and it stalls the step's threads at their barriers
            handed = (self._handed if self._handoff and len(deliveries) <= HANDOFF_MAX_STREAMS
                      else None)
            if handed is not None:
                handed.clear()
            self._call_soon(_deliver, deliveries, handed)
            if handed is not None:
                handed.wait(HANDOFF_WAIT_S)

    def _reset(self, request_ids: list[str]) -> None:
        """After a failed step: abort the batch and let one step drop its state."""
        self.engine.abort_request(request_ids)
        try:
            self.engine.step()
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"the engine could not recover from a failed step: {e!r}") from e
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine still holds requests after a reset")
        self.engine.check_integrity()  # every block back in the pool, or the engine is dead

    def _fail_all(self, error: BaseException) -> None:
        if not self._streams:
            return
        ids = list(self._streams)
        deliveries = [(stream, error) for stream in self._streams.values()]
        self._streams.clear()
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001 - the streams are failed either way
            logger.exception("abort after failure raised")
        self._call_soon(_deliver, deliveries)

    def _drain_after_exit(self) -> None:
        """Answer commands that arrived after the thread stopped, so no caller hangs."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                error = EngineDeadError("the engine is shutting down")
                self._call_soon(_resolve, command.done, error)

    def _publish_snapshot(self) -> None:
        sched, stats = self.engine.scheduler, self.engine.stats
        prefix = sched.prefix_cache_stats
        self.snapshot = EngineSnapshot(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_cache_usage=sched.kv_cache_usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=sched.num_preemptions_total,
            prompt_tokens=stats.prompt_tokens_total,
            generation_tokens=stats.generation_tokens_total,
            max_waiting_requests=self.max_waiting_requests,
            num_rejected=self._num_rejected,
            spec_decode=sched.spec.stats.copy() if sched.spec is not None
            and sched.spec.reported else None,
        )

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to answer
            logger.debug("event loop closed; dropped a delivery")


def _resolve(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.cancelled():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _deliver(deliveries: list[tuple[RequestStream, RequestOutput | BaseException]],
             handed: threading.Event | None = None) -> None:
    for stream, item in deliveries:
        stream.put(item)
    if handed is not None:  # set after the tasks the items woke (the ready queue is FIFO)
        asyncio.get_running_loop().call_soon(handed.set)
