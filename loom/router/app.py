"""The router's HTTP side: OpenAI routes proxied to a replica, /health, /metrics.

Generation routes (and embeddings) pick a replica by the policy; the others (models,
tokenize, version) go to the least loaded one. A request is retried on another replica when
its replica cannot be reached, answers 503, or fails before the router has sent the client
anything: a whole non-streamed answer, or a stream's first bytes. A stream cut after that
ends with an error event in OpenAI's envelope. Errors of the router itself use the same
envelope. A /v1/responses answer's id is remembered with its replica, whose in-memory store
holds it: a continuation (`previous_response_id`), GET and DELETE of it go there.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom import __version__
from loom.errors import error_body
from loom.router.args import RouterArgs
from loom.router.backends import Backend, BackendPool
from loom.router.metrics import CONTENT_TYPE, RouterMetrics
from loom.router.policy import LeastLoad, Policy, block_hashes, make_policy, prompt_text

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20
# Request headers not passed on (hop-by-hop, or set again by the client library).
_DROP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                 "accept-encoding", "upgrade", "te", "trailer", "proxy-authorization"}
_PASS_BACK = ("content-type", "retry-after", "x-request-id")


def _forward_headers(request: Request) -> dict[str, str]:
    """The client's headers a replica gets (hop-by-hop ones dropped)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}


def error(status: int, message: str, param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


# /v1/responses ids the router remembers (the replica that answered each), newest kept: a
# continuation (previous_response_id), GET or DELETE must reach the replica that stored it.
RESPONSES_ROUTED = 4096
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp-[0-9a-f]+)"')
_SCAN_BYTES = 64 * 1024  # a stream's first bytes searched for its response id


class _Retry(Exception):
    """This attempt failed before anything reached the client; try another replica."""


class Router:
    def __init__(self, args: RouterArgs) -> None:
        self.args = args
        self.pool = BackendPool(args.backends, args.health_check_interval)
        self.policy: Policy = make_policy(args.policy, args.balance_abs_threshold,
                                          args.balance_rel_threshold)
        self.least_load = LeastLoad()
        self.metrics = RouterMetrics(self.pool)
        self.client: httpx.AsyncClient | None = None
        self.responses: OrderedDict[str, str] = OrderedDict()  # response id -> backend url

    def remember(self, response_id: str, backend: Backend) -> None:
        self.responses[response_id] = backend.url
        self.responses.move_to_end(response_id)
        while len(self.responses) > RESPONSES_ROUTED:
            self.responses.popitem(last=False)

    def _scan(self, backend: Backend, data: bytes) -> bool:
        """Remember the response id in a /v1/responses answer's bytes; whether one was."""
        found = _RESPONSE_ID.search(data)
        if found is not None:
            self.remember(found.group(1).decode(), backend)
        return found is not None

    async def proxy_to_owner(self, request: Request, method: str, response_id: str,
                             body: bytes = b"", stream: bool = False) -> Response:
        """A request about a stored response, sent to the replica that answered it (its
        store is that replica's); 404 for an id this router did not route. `stream`: the
        body asks for a stream."""
        url = self.responses.get(response_id)
        if url is None:
            return error(404, f"no response with id {response_id!r} was answered through this "
                              f"router (it remembers the newest {RESPONSES_ROUTED})",
                         "previous_response_id" if method == "POST" else None, "not_found")
        backend = next((b for b in self.pool.healthy() if b.url == url), None)
        if backend is None:
            return error(503, f"the replica holding response {response_id!r} ({url}) is not "
                              "healthy", code="no_healthy_backend")
        headers = _forward_headers(request)
        try:
            return await self._attempt(backend, method, request.url.path, headers, body, stream)
        except _Retry as e:
            return error(503, f"the replica holding response {response_id!r} failed: {e}",
                         code="no_healthy_backend")

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        if self.client is not None:
            await self.client.aclose()

    async def proxy(self, request: Request, method: str, body: bytes = b"",
                    parsed: dict[str, Any] | None = None) -> Response:
        """Send the request to a replica (retrying as the module says) and relay its answer."""
        t0 = time.perf_counter()
        path = request.url.path
        headers = _forward_headers(request)
        stream = parsed is not None and parsed.get("stream") is True
        hashes = (block_hashes(prompt_text(parsed), self.args.block_chars)
                  if parsed is not None else [])
        policy = self.policy if parsed is not None else self.least_load
        tried: set[str] = set()
        reasons: list[str] = []
        for attempt in range(self.args.max_attempts):
            candidates = [b for b in self.pool.healthy() if b.url not in tried]
            if not candidates:
                break
            backend, matched = policy.choose(candidates, hashes)
            tried.add(backend.url)
            if attempt == 0:  # the first choice gives the routing figures
                self.metrics.routing.observe(time.perf_counter() - t0)
                self.metrics.prompt_blocks.inc(len(hashes))
                self.metrics.matched_blocks.inc(matched)
            try:
                return await self._attempt(backend, method, path, headers, body, stream)
            except _Retry as e:
                reasons.append(f"{backend.url}: {e}")
                self.metrics.retries.labels(backend.url).inc()
                logger.warning("%s %s failed on %s (%s); retrying elsewhere", method, path,
                               backend.url, e)
        self.metrics.requests.labels("", "503").inc()
        detail = "; ".join(reasons) or (f"none of {len(self.pool.backends)} replicas passes its "
                                        "health checks")
        return error(503, f"no healthy backend to serve the request ({detail})",
                     code="no_healthy_backend")

    async def _attempt(self, backend: Backend, method: str, path: str,
                       headers: dict[str, str], body: bytes, stream: bool) -> Response:
        assert self.client is not None
        backend.in_flight += 1
        handed_over = False  # a stream's relay releases in_flight when it ends
        try:
            req = self.client.build_request(method, backend.url + path, headers=headers,
                                            content=body or None)
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.TransportError as e:
                backend.mark_down(f"{type(e).__name__}: {e}")
                raise _Retry(f"unreachable: {type(e).__name__}") from None
            try:
                if resp.status_code == 503:
                    raise _Retry("answered 503")
                back = {k: resp.headers[k] for k in _PASS_BACK if k in resp.headers}
                back["x-loom-backend"] = backend.url
                responses = path == "/v1/responses" and method == "POST"
                if not stream or resp.status_code != 200:
                    content = await resp.aread()
                    self.metrics.requests.labels(backend.url, str(resp.status_code)).inc()
                    if responses and resp.status_code == 200:
                        self._scan(backend, content[:_SCAN_BYTES])
                    return Response(content, resp.status_code, headers=back)
                chunks = resp.aiter_raw()
                first = await anext(chunks, b"")
            except httpx.TransportError as e:
                await resp.aclose()
                backend.mark_down(f"{type(e).__name__}: {e}")
                raise _Retry(f"failed before answering: {type(e).__name__}") from None
            except _Retry:
                await resp.aclose()
                raise
            self.metrics.requests.labels(backend.url, "200").inc()
            handed_over = True
            return StreamingResponse(self._relay(backend, resp, first, chunks, responses), 200,
                                     headers=back)
        finally:
            if not handed_over:
                backend.in_flight -= 1

    async def _relay(self, backend: Backend, resp: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], scan: bool = False) -> AsyncIterator[bytes]:
        """`scan`: a /v1/responses stream, whose first event names its id."""
        seen = first
        try:
            if scan and self._scan(backend, seen):
                scan = False
            yield first
            async for chunk in chunks:
                if scan:  # (the id may straddle chunks)
                    seen = (seen + chunk)[-_SCAN_BYTES:]
                    scan = not self._scan(backend, seen) and len(seen) < _SCAN_BYTES
                yield chunk
        except httpx.TransportError as e:
            backend.mark_down(f"{type(e).__name__}: {e}")
            self.metrics.stream_failures.labels(backend.url).inc()
            err = error_body(500, f"the replica failed while streaming ({type(e).__name__}); "
                             "the answer is incomplete", code="backend_failed")
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            backend.in_flight -= 1
            await resp.aclose()


async def _json_body(request: Request, required: str) -> tuple[bytes, dict[str, Any]] | Response:
    """The raw body and its JSON object, or the 400/413 answer for a body that is not one."""
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        return error(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return error(400, f"the request body is not valid JSON: {e}")
    if not isinstance(parsed, dict):
        return error(400, "the request body must be a JSON object")
    if required not in parsed:
        return error(400, f"missing required field '{required}'", param=required)
    if required == "messages" and not (isinstance(parsed["messages"], list)
                                       and parsed["messages"]):
        return error(400, "messages must be a non-empty list", param="messages")
    return body, parsed


def build_app(args: RouterArgs) -> FastAPI:
    router = Router(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        logger.info("routing (%s) to %d replicas: %s", args.policy, len(args.backends),
                    ", ".join(args.backends))
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="Loom router", version=__version__, lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("router error on %s", request.url.path)
        return error(500, f"internal router error: {type(exc).__name__}")

    async def generate(request: Request, required: str) -> Response:
        got = await _json_body(request, required)
        if isinstance(got, Response):
            return got
        return await router.proxy(request, "POST", *got)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "messages")

    @app.post("/v1/messages")  # Anthropic's Messages API
    async def messages(request: Request) -> Response:
        return await generate(request, "messages")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await generate(request, "input")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        got = await _json_body(request, "input")
        if isinstance(got, Response):
            return got
        body, parsed = got
        previous = parsed.get("previous_response_id")
        if isinstance(previous, str):  # the conversation is stored on one replica
            return await router.proxy_to_owner(request, "POST", previous, body,
                                               parsed.get("stream") is True)
        return await router.proxy(request, "POST", body, parsed)

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        return await router.proxy_to_owner(request, request.method, response_id)

    @app.post("/tokenize")
    @app.post("/detokenize")
    @app.post("/v1/messages/count_tokens")
    async def tokenize(request: Request) -> Response:
        return await router.proxy(request, "POST", await request.body())

    @app.get("/v1/models")
    @app.get("/version")
    async def models(request: Request) -> Response:
        return await router.proxy(request, "GET")

    @app.get("/health")
    async def health() -> Response:
        n = len(router.pool.healthy())
        if n == 0:
            return error(503, "no healthy backend", code="no_healthy_backend")
        return JSONResponse({"status": "ok", "healthy_backends": n,
                             "backends": len(router.pool.backends)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    return app


class _Server(uvicorn.Server):
    """Exits normally (status 0, `finally` blocks run) on SIGTERM/SIGINT after letting open
    requests finish; uvicorn would re-raise the signal. A second signal stops at once."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def run_router(args: RouterArgs) -> None:
    """Serve until SIGTERM/SIGINT."""
    logging.getLogger().setLevel(args.log_level.upper())
    config = uvicorn.Config(build_app(args), host=args.host, port=args.port,
                            log_level=args.log_level, access_log=False)
    _Server(config).run()
    logger.info("router stopped")
