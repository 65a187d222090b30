"""POST /v1/chat/completions: messages -> chat template -> one engine request (n samples).

Streaming sends, per choice, a first chunk with the assistant role, then content deltas, and
the finish_reason in the choice's last chunk. Logprobs use the chat format: `content` is a list
of {token, logprob, bytes, top_logprobs}.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from loom.entrypoints.openai.errors import APIError, bad_request, from_exception
from loom.entrypoints.openai.serving_common import (
    ServerContext,
    add_requests,
    build_sampling_params,
    cancel_on_disconnect,
    check_stream_options,
    collect_final,
    include_usage,
    logprob_value,
    merge_streams,
    new_id,
    sse,
    sse_guard,
    usage,
)
from loom.tokenizer.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from loom.core.sched_output import Logprobs
    from loom.engine.async_engine import RequestStream
    from loom.engine.outputs import RequestOutput
    from loom.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage


def render_messages(
    ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of the conversation in the chat template; template errors are 400s."""
    conversation: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": m.text()}
        if m.name is not None:
            item["name"] = m.name
        conversation.append(item)
    try:
        return ctx.tokenizer.encode_chat(conversation, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as e:
        raise from_exception(e) from None


async def create_chat_completion(
    ctx: ServerContext, req: ChatCompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    """Validate, render the conversation, add the request, answer streamed or whole."""
    try:
        return await _create(ctx, req, raw_request)
    except APIError as e:  # name the fields as this endpoint calls them
        if e.param == "logprobs":
            e.param = "top_logprobs"
        elif e.param == "max_tokens" and req.max_completion_tokens is not None:
            e.param = "max_completion_tokens"
        raise


async def _create(
    ctx: ServerContext, req: ChatCompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    ctx.check_model(req.model)
    check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(req, max_tokens, logprobs)
    prompt_ids = render_messages(ctx, req.messages)
    request_id = new_id("chatcmpl")
    builder = _Builder(ctx, req, request_id, int(time.time()), params.n)
    if req.stream:
        streams = await add_requests(ctx, request_id, [prompt_ids], params)
        return StreamingResponse(sse_guard(builder.stream(streams)),
                                 media_type="text/event-stream")

    async def work() -> JSONResponse:
        streams = await add_requests(ctx, request_id, [prompt_ids], params)
        (final,) = await collect_final(streams)
        return JSONResponse(builder.response(final))

    return await cancel_on_disconnect(raw_request, work)


class _Builder:
    """Turns engine outputs of one chat request into OpenAI chat JSON."""

    def __init__(
        self, ctx: ServerContext, req: ChatCompletionRequest, request_id: str, created: int,
        n: int,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.id = request_id
        self.created = created
        self.n = n

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.ctx.token_text(token_id)
        return {"token": text, "logprob": logprob_value(logprob),
                "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, token_ids: list[int], lps: list[Logprobs]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        content = []
        for token_id, lp in zip(token_ids, lps):
            entry = self._token(token_id, lp.logprobs[0])
            entry["top_logprobs"] = [self._token(t, v)
                                     for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])]
            content.append(entry)
        return {"content": content}

    def response(self, final: RequestOutput) -> dict[str, Any]:
        """The whole (non-streamed) chat completion."""
        choices = [
            {"index": o.index, "message": {"role": "assistant", "content": o.text},
             "logprobs": self._logprobs(o.token_ids, o.logprobs or []),
             "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
            for o in final.outputs
        ]
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices,
                "usage": usage(len(final.prompt_token_ids), completion_tokens)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.ctx.model_name,
                                 "choices": choices}
        if include_usage(self.req):
            chunk["usage"] = None
        return chunk

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """SSE events: role chunks, content deltas, finish chunks, then usage if asked."""
        for i in range(self.n):
            yield sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]))
        done: dict[int, int] = {}  # choice index -> completion tokens, once finished
        prompt_tokens = 0
        async for _, out in merge_streams(streams):
            prompt_tokens = len(out.prompt_token_ids)
            for o in out.outputs:
                if o.index in done:
                    continue
                logprobs = self._logprobs(o.delta_token_ids, o.delta_logprobs)
                has_logprobs = logprobs is not None and bool(logprobs["content"])
                if not (o.delta_text or o.finished or has_logprobs):
                    continue
                delta = {"content": o.delta_text} if o.delta_text else {}
                choice = {"index": o.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                yield sse(self._chunk([choice]))
                if o.finished:
                    done[o.index] = len(o.token_ids)
        if include_usage(self.req):
            usage_chunk = self._chunk([])
            usage_chunk["usage"] = usage(prompt_tokens, sum(done.values()))
            yield sse(usage_chunk)
