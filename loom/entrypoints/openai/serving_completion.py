"""POST /v1/completions: prompts -> engine requests -> a completion or an SSE stream.

Choice index = prompt_index * n + sample_index (OpenAI's order for several prompts).
Logprobs use the legacy format: tokens, token_logprobs, top_logprobs (dicts), text_offset.
With `echo`, each choice starts with its prompt text (and, with `logprobs`, the prompt's
logprobs; the first prompt token has none). `echo` with `max_tokens: 0` scores the prompt alone:
the engine samples one token, which is not reported.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from loom.engine.outputs import CompletionOutput
from loom.entrypoints.openai.errors import bad_request
from loom.entrypoints.openai.serving_beam import create_beam_completion
from loom.entrypoints.openai.serving_common import (
    ServerContext,
    add_requests,
    as_prompts,
    build_sampling_params,
    cancel_on_disconnect,
    check_prompt_logprobs,
    check_prompt_sizes,
    check_stream_options,
    collect_final,
    constraint_source,
    include_usage,
    logprob_value,
    merge_streams,
    new_id,
    prompt_logprobs_of,
    sse,
    sse_guard,
    usage,
    vllm_prompt_logprobs,
)

if TYPE_CHECKING:
    from loom.core.sched_output import Logprobs
    from loom.engine.async_engine import RequestStream
    from loom.engine.outputs import RequestOutput
    from loom.entrypoints.openai.protocol import CompletionRequest

_Entry = tuple[int, "Logprobs | None"]


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported (no fill-in-the-middle)", "suffix")
    if req.best_of is not None and req.best_of != 1 and not req.use_beam_search:
        raise bad_request("best_of is not supported; use n to get several samples", "best_of")
    if not req.use_beam_search:
        for name, default in (("beam_width", None), ("length_penalty", 1.0),
                              ("early_stopping", False)):
            if getattr(req, name) not in (None, default):
                raise bad_request(f"{name} needs use_beam_search", name)


async def create_completion(
    ctx: ServerContext, req: CompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    """Validate, add one engine request per prompt, answer streamed or whole."""
    ctx.check_model(req.model)
    _check_unsupported(req)
    check_stream_options(req)
    prompts = as_prompts(req.prompt, "prompt")
    if req.use_beam_search:  # loom/entrypoints/openai/serving_beam.py
        return JSONResponse(await cancel_on_disconnect(
            raw_request, lambda: create_beam_completion(ctx, req, prompts)))
    check_prompt_logprobs(req)
    asked = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs)
             if n is not None]
    prompt_logprobs = max(asked) if asked else None  # each answer keeps its own top N
    prompt_only = bool(req.echo) and req.max_tokens == 0
    max_tokens = 1 if prompt_only else req.max_tokens
    params = build_sampling_params(req, max_tokens, req.logprobs, prompt_logprobs)
    # a 400 before add_requests' 503 and 429
    check_prompt_sizes(ctx, prompts, truncated=req.truncate_prompt_tokens is not None)
    source = constraint_source(req)
    request_id = new_id("cmpl")
    builder = _Builder(ctx, req, request_id, int(time.time()), params.n, prompt_only)
    if req.stream:
        streams = await add_requests(ctx, request_id, prompts, params, source,
                                     add_special_tokens=req.add_special_tokens,
                                     priority=req.priority)
        return StreamingResponse(sse_guard(builder.stream(streams)),
                                 media_type="text/event-stream")

    async def work() -> JSONResponse:
        streams = await add_requests(ctx, request_id, prompts, params, source,
                                     add_special_tokens=req.add_special_tokens,
                                     priority=req.priority)
        return JSONResponse(builder.response(await collect_final(streams)))

    return await cancel_on_disconnect(raw_request, work)


class _Builder:
    """Turns engine outputs of one HTTP request into OpenAI completion JSON."""

    def __init__(
        self, ctx: ServerContext, req: CompletionRequest, request_id: str, created: int, n: int,
        prompt_only: bool,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.id = request_id
        self.created = created
        self.n = n
        self.prompt_only = prompt_only

    def _visible(self, o: CompletionOutput) -> CompletionOutput:
        """What the client sees of a sample: nothing generated in prompt-only mode."""
        if not self.prompt_only:
            return o
        return CompletionOutput(o.index, logprobs=None if o.logprobs is None else [],
                                finish_reason="length" if o.finished else None)

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.ctx.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _prompt_entries(self, out: RequestOutput) -> list[_Entry]:
        return list(zip(out.prompt_token_ids, prompt_logprobs_of(out)))

    def _logprobs(self, entries: list[_Entry], offset: int) -> dict[str, Any]:
        """Legacy logprobs; `offset` is where the first token's text starts in the choice."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        as_id = self.req.return_tokens_as_token_ids
        n = 1 + (self.req.logprobs or 0)  # (prompt entries may hold vLLM's prompt_logprobs)
        for token_id, lp in entries:
            text = self.ctx.token_text(token_id)
            name = self.ctx.token_name(token_id, as_id)
            tokens.append(name)
            text_offset.append(offset)
            offset += len(text)
            if lp is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(logprob_value(lp.logprobs[0]))
            top = {self.ctx.token_name(t, as_id): logprob_value(v)
                   for t, v in zip(lp.token_ids[1:n], lp.logprobs[1:n])}
            top.setdefault(name, logprob_value(lp.logprobs[0]))
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": text_offset}

    def _choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, o: CompletionOutput,
        final: bool,
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": o.finish_reason if final else None,
                "stop_reason": o.stop_reason if final else None}

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The whole (non-streamed) completion."""
        choices = []
        prompt_tokens = completion_tokens = 0
        for p, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for o in map(self._visible, out.outputs):
                completion_tokens += len(o.token_ids)
                prefix = self._prompt_text(out) if self.req.echo else ""
                logprobs = None
                if self.req.logprobs is not None:
                    entries = self._prompt_entries(out) if self.req.echo else []
                    entries += list(zip(o.token_ids, o.logprobs or []))
                    logprobs = self._logprobs(entries, 0)
                choice = self._choice(p * self.n + o.index, prefix + o.text, logprobs, o, True)
                if self.req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(
                        self.ctx, out, self.req.prompt_logprobs)
                choices.append(choice)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": "text_completion",
                                 "created": self.created, "model": self.ctx.model_name,
                                 "choices": choices}
        if include_usage(self.req):
            chunk["usage"] = None
        return chunk

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """SSE events: one chunk per choice that changed, then the usage chunk if asked."""
        started: set[int] = set()  # choice indices that sent a chunk (the echo went first)
        # choice index -> where its next token's text starts (the tokens' texts summed, as the
        # whole response counts them: text held back for a stop string does not shift them)
        token_offset: dict[int, int] = {}
        done: dict[int, int] = {}  # choice index -> completion tokens, once finished
        prompt_tokens = [0] * len(streams)
        want_logprobs = self.req.logprobs is not None
        async for p, out in merge_streams(streams):
            prompt_tokens[p] = len(out.prompt_token_ids)
            for o in map(self._visible, out.outputs):
                index = p * self.n + o.index
                if index in done:
                    continue
                text, entries = o.delta_text, list(zip(o.delta_token_ids, o.delta_logprobs))
                if self.req.echo and index not in started and (o.token_ids or o.finished):
                    text = self._prompt_text(out) + text
                    entries = self._prompt_entries(out) + entries if want_logprobs else entries
                if not (text or o.finished or (want_logprobs and entries)):
                    continue
                started.add(index)
                logprobs = None
                if want_logprobs:
                    offset = token_offset.get(index, 0)
                    logprobs = self._logprobs(entries, offset)
                    token_offset[index] = offset + sum(map(len, logprobs["tokens"]))
                yield sse(self._chunk([self._choice(index, text, logprobs, o, o.finished)]))
                if o.finished:
                    done[index] = len(o.token_ids)
        if include_usage(self.req):
            usage_chunk = self._chunk([])
            usage_chunk["usage"] = usage(sum(prompt_tokens), sum(done.values()))
            yield sse(usage_chunk)
