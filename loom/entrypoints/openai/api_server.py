"""`loom serve`: routes of the OpenAI-compatible server, the API-key check, and the uvicorn
server with a graceful SIGTERM/SIGINT shutdown.

Request path: protocol.py validates the body -> serving_{completion,chat}.py builds
SamplingParams and adds engine requests -> AsyncEngine (engine thread) -> per-request queues ->
JSON or SSE. Every error leaves in OpenAI's envelope (errors.py).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from loom import __version__
from loom.engine.async_engine import AsyncEngine, EngineShutdownError
from loom.entrypoints.openai import web
from loom.entrypoints.openai.body import (
    BodySizeLimitMiddleware, install_openapi, openapi_body, parse_body,
)
from loom.entrypoints.openai.errors import APIError, bad_request, install_error_handlers
from loom.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    MessagesCountRequest,
    MessagesRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from loom.entrypoints.openai.server_args import DEFAULT_MAX_REQUEST_BODY_BYTES
from loom.entrypoints.openai.serving_chat import create_chat_completion, render_messages
from loom.entrypoints.openai.serving_common import ServerContext
from loom.entrypoints.openai.serving_completion import create_completion
from loom.entrypoints.openai.serving_embedding import EmbeddingRequest, embeddings_route
from loom.entrypoints.openai.serving_messages import count_tokens, create_message
from loom.entrypoints.openai.serving_responses import create_response
from loom.entrypoints.openai.startup import startup_line

if TYPE_CHECKING:
    from loom.engine.args import EngineArgs
    from loom.entrypoints.openai.server_args import ServerArgs

__all__ = ["build_app", "run_server"]

logger = logging.getLogger(__name__)

# Routes that answer without an API key (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", *web.OPEN_PATHS})

router = APIRouter()


def _ctx(request: Request) -> ServerContext:
    return request.app.state.loom


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine runs and the server accepts requests, else 503."""
    ctx = _ctx(request)
    if ctx.shutting_down or not ctx.engine.is_running:
        return APIError(503, "the server is not serving").response()
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    card = {"id": ctx.model_name, "object": "model", "created": request.app.state.started,
            "owned_by": "loom", "root": ctx.model_name, "max_model_len": ctx.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


# Bodies are parsed and validated on a worker thread (body.py), not by FastAPI on the loop.
@router.post("/v1/completions", response_model=None, openapi_extra=openapi_body(CompletionRequest))
async def completions(request: Request) -> JSONResponse | StreamingResponse:
    """OpenAI completions; see serving_completion.py."""
    body = await parse_body(request, CompletionRequest)
    return await create_completion(_ctx(request), body, request)


@router.post("/v1/chat/completions", response_model=None,
             openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
    """OpenAI chat completions; see serving_chat.py."""
    body = await parse_body(request, ChatCompletionRequest)
    return await create_chat_completion(_ctx(request), body, request)


@router.post("/v1/responses", response_model=None, openapi_extra=openapi_body(ResponsesRequest))
async def responses(request: Request) -> JSONResponse | StreamingResponse:
    """OpenAI's Responses API; see serving_responses.py."""
    body = await parse_body(request, ResponsesRequest)
    return await create_response(_ctx(request), body, request)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> JSONResponse:
    """A stored response (POST /v1/responses without `store: false`)."""
    return JSONResponse(_ctx(request).responses.get(response_id)[0])


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    _ctx(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/messages", response_model=None, openapi_extra=openapi_body(MessagesRequest))
async def messages(request: Request) -> JSONResponse | StreamingResponse:
    """Anthropic's Messages API; see serving_messages.py."""
    return await create_message(_ctx(request), request)


@router.post("/v1/messages/count_tokens", openapi_extra=openapi_body(MessagesCountRequest))
async def messages_count_tokens(request: Request) -> JSONResponse:
    return await count_tokens(_ctx(request), request)


router.add_api_route("/v1/embeddings", embeddings_route, methods=["POST"], response_model=None,
                     openapi_extra=openapi_body(EmbeddingRequest))  # see serving_embedding.py


@router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(request: Request) -> JSONResponse:
    """Token ids of `prompt`, or of `messages` rendered with the chat template (vLLM's shape)."""
    body = await parse_body(request, TokenizeRequest)
    ctx = _ctx(request)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        tokens = await asyncio.to_thread(render_messages, ctx, body.messages, body)
    else:
        prompt = body.prompt or ""
        ctx.check_text_size(len(prompt), "prompt")
        tokens = await asyncio.to_thread(ctx.tokenizer.encode, prompt, body.add_special_tokens)
    return JSONResponse({"count": len(tokens), "max_model_len": ctx.max_model_len,
                         "tokens": tokens})


@router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    body = await parse_body(request, DetokenizeRequest)
    ctx = _ctx(request)
    ctx.check_model(body.model)
    vocab = ctx.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
    # A body-sized list of ids takes as long to decode as one to tokenize: off the event loop.
    return JSONResponse({"prompt": await asyncio.to_thread(ctx.tokenizer.decode, body.tokens)})


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, or Anthropic's `x-api-key: <key>`
    (constant-time); OPEN_PATHS are free."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
        if (given is not None and hmac.compare_digest(given, self.expected)) or (
                key is not None and hmac.compare_digest(key, self.key)):
            await self.app(scope, receive, send)
            return
        given = given if given is not None else key
        message = ("missing API key: send the header 'Authorization: Bearer <key>'"
                   if given is None else "invalid API key")
        await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)


def build_app(
    ctx: ServerContext, metrics: ServerMetrics, api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The ASGI app; starting it (lifespan) starts the engine thread, stopping it stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            await ctx.engine.shutdown()

    app = FastAPI(title="Loom", version=__version__, lifespan=lifespan)
    app.state.loom = ctx
    app.state.metrics = metrics
    app.state.started = int(time.time())
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    app.include_router(router)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                          DetokenizeRequest, EmbeddingRequest])
    app.include_router(web.router)  # the chat page, /dashboard and its feed
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of re-raising the signal.

    First signal: refuse new requests (503; uvicorn closes the listening socket), let running
    ones finish for `grace` seconds, then abort the rest with an error; the process exits 0.
    A second signal aborts everything at once.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, grace: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grace_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in signal context, between any two bytecodes of the main thread (say, inside a
        # log call): only set flags here and leave the rest (logging too) to the event loop.
        # Not recorded in _captured_signals: uvicorn would re-raise it and exit with 128+sig.
        if self._loop is None:
            self.should_exit = True
        elif self.should_exit:
            self.force_exit = True
            self._loop.call_soon_threadsafe(self._on_second_signal, sig)
        else:
            self.should_exit = True
            self.ctx.shutting_down = True
            self._loop.call_soon_threadsafe(self._on_first_signal, sig)

    def _on_first_signal(self, sig: int) -> None:
        logger.info("%s: draining; running requests get %g s", signal.Signals(sig).name,
                    self.grace)
        self._grace_task = asyncio.ensure_future(self._abort_after_grace())

    def _on_second_signal(self, sig: int) -> None:
        logger.warning("%s again: aborting every request now", signal.Signals(sig).name)
        self._abort_all()

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self.grace)
        self._abort_all()

    def _abort_all(self) -> None:
        self.ctx.engine.abort_all(EngineShutdownError(
            "the server is shutting down and the request did not finish within the grace period"
        ))


def run_server(engine_args: EngineArgs, args: ServerArgs) -> None:
    """Load the model, then serve until SIGTERM/SIGINT (see GracefulServer)."""
    from loom.config import ConfigError
    from loom.engine.llm_engine import LLMEngine
    from loom.loader.resolve import ModelNotFoundError

    logging.getLogger().setLevel(args.log_level.upper())
    try:
        engine = LLMEngine(engine_args)
    except (ConfigError, ModelNotFoundError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    # The model, tokenizer and caches live as long as the server: out of the collector's way
    # (as vLLM does), so its full collections do not walk them again and again. (No
    # gc.collect() first: it would add to the start-up.) Here, not in LLMEngine: the process
    # is Loom's.
    gc.freeze()
    async_engine = AsyncEngine(engine, args.max_waiting_requests)
    metrics = ServerMetrics(lambda: async_engine.snapshot, engine.model_name)
    async_engine.on_output = metrics.observe
    ctx = ServerContext(
        engine=async_engine, tokenizer=engine.tokenizer, model_name=engine.model_name,
        max_model_len=engine.scheduler_config.max_model_len,
        log_requests=not args.disable_log_requests, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_token_chars=engine.tokenizer.max_token_chars,
    )
    app = build_app(ctx, metrics, args.api_key, args.max_request_body_bytes)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        access_log=not args.disable_log_requests,
        # A backstop only: GracefulServer aborts leftovers after the grace period itself.
        timeout_graceful_shutdown=int(args.timeout_graceful_shutdown) + 5,
    )
    logger.info("%s", startup_line(engine, args.host, args.port))
    GracefulServer(config, ctx, args.timeout_graceful_shutdown).run()
    logger.info("server stopped")
