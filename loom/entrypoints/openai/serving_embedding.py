"""POST /v1/embeddings (OpenAI's shape): inputs -> embedding requests through the engine's
scheduler -> pooled, normalised hidden states as floats or base64 (little-endian float32).

`input` is a string, a list of strings, a list of token ids or a list of such lists. The
pooling is the model's (LLM.embed); `dimensions` other than the model's width is refused (Loom
does not truncate embeddings), as is an empty input.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from loom.entrypoints.openai.body import parse_body
from loom.entrypoints.openai.errors import APIError, bad_request
from loom.entrypoints.openai.protocol import OpenAIBaseModel, Prompt
from loom.entrypoints.openai.serving_common import (
    ServerContext,
    add_requests,
    as_prompts,
    cancel_on_disconnect,
    check_prompt_sizes,
    collect_final,
    new_id,
)
from loom.sampling_params import SamplingParams, SamplingParamsError


class EmbeddingRequest(OpenAIBaseModel):
    input: Prompt  # as /v1/completions' prompt: one form per value, the first bad item named
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last N tokens
    priority: int = 0  # vLLM's: --scheduling-policy priority's rank (lower first)


def _inputs(ctx: ServerContext, req: EmbeddingRequest) -> list[str | list[int]]:
    inputs = as_prompts(req.input, "input")
    for i, item in enumerate(inputs):
        if not item:
            param = "input" if len(inputs) == 1 else f"input[{i}]"
            raise bad_request(f"{param} must not be empty", param)
    check_prompt_sizes(ctx, inputs, "input", truncated=req.truncate_prompt_tokens is not None)
    return inputs


def _encode(vec: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vec
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest,
                           raw_request: Request) -> JSONResponse:
    ctx.check_model(req.model)
    config = ctx.engine.engine.model_config
    if req.dimensions is not None and req.dimensions != config.hidden_size:
        raise bad_request(f"dimensions {req.dimensions} is not supported: this model's "
                          f"embeddings have {config.hidden_size}", "dimensions")
    inputs = _inputs(ctx, req)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=config.pooling,
                                truncate_prompt_tokens=req.truncate_prompt_tokens)
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from None

    async def work() -> JSONResponse:
        streams = await add_requests(ctx, new_id("embd"), inputs, params,
                                     priority=req.priority)
        outputs = await collect_final(streams)
        data = []
        for i, out in enumerate(outputs):
            if out.embedding is None:
                raise APIError(500, f"input {i} gave no embedding: {out.error}")
            data.append({"object": "embedding", "index": i,
                         "embedding": _encode(out.embedding, req.encoding_format)})
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return JSONResponse({"object": "list", "data": data, "model": ctx.model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return await cancel_on_disconnect(raw_request, work)


async def embeddings_route(request: Request) -> JSONResponse:
    """The route's handler (registered in api_server.py)."""
    body = await parse_body(request, EmbeddingRequest)
    return await create_embedding(request.app.state.loom, body, request)
