"""Beam search on /v1/completions: `use_beam_search: true` with `beam_width` (vLLM's extras;
`best_of`, else `n`, when beam_width is absent), `length_penalty` and `early_stopping`.

Each step's beams are engine requests of one token (loom.engine.beam_search.BeamSearch); the
answer holds the best `n` beams of each prompt (choice index = prompt_index * n + rank). Fields
beam search does not combine with are refused with a 400 naming them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from loom.engine.beam_search import BeamSearch, BeamSearchParams
from loom.entrypoints.openai.errors import bad_request
from loom.entrypoints.openai.serving_common import (
    add_requests, collect_final, new_id, tokenize_prompts_async, usage,
)

if TYPE_CHECKING:
    from loom.entrypoints.openai.protocol import CompletionRequest
    from loom.entrypoints.openai.serving_common import ServerContext

# Fields that must keep their defaults with use_beam_search (beam search ignores them otherwise).
_DEFAULTS: dict[str, Any] = {
    "stream": False, "echo": False, "logprobs": None, "top_p": None, "top_k": None,
    "min_p": None, "presence_penalty": None, "frequency_penalty": None,
    "repetition_penalty": None, "logit_bias": None, "stop": None, "stop_token_ids": None,
    "min_tokens": 0, "response_format": None, "structured_outputs": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None, "suffix": None,
    "include_stop_str_in_output": False, "stream_options": None, "allowed_token_ids": None,
    "bad_words": None, "truncate_prompt_tokens": None, "prompt_logprobs": None,
    "return_tokens_as_token_ids": False,
}


def beam_params(req: CompletionRequest) -> tuple[BeamSearchParams, int]:
    """The search's parameters and the number of beams returned per prompt; 400 on fields
    it does not support."""
    for name, default in _DEFAULTS.items():
        value = getattr(req, name, default)
        if value is not None and value != default:
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    if req.temperature not in (None, 0, 0.0):
        raise bad_request("use_beam_search needs temperature 0 (or unset)", "temperature")
    n = req.n if req.n is not None else 1
    width = next(w for w in (req.beam_width, req.best_of, n) if w is not None)  # 0 is a value
    if n < 1 or width < 1:
        raise bad_request("n and beam_width must be positive", "beam_width")
    if n > width:
        raise bad_request(f"n ({n}) exceeds beam_width ({width})", "n")
    if req.max_tokens is None or req.max_tokens < 1:
        raise bad_request("use_beam_search needs max_tokens >= 1", "max_tokens")
    early = req.early_stopping if req.early_stopping is not None else False
    try:
        params = BeamSearchParams(beam_width=width, max_tokens=req.max_tokens,
                                  ignore_eos=bool(req.ignore_eos),
                                  length_penalty=req.length_penalty
                                  if req.length_penalty is not None else 1.0,
                                  early_stopping=early)
    except ValueError as e:
        raise bad_request(str(e), "beam_width") from None
    return params, n


async def create_beam_completion(ctx: ServerContext, req: CompletionRequest,
                                 prompts: list[str | list[int]]) -> dict[str, Any]:
    params, n = beam_params(req)
    ids = await tokenize_prompts_async(ctx, prompts, add_special_tokens=req.add_special_tokens)
    try:
        search = BeamSearch(ids, params, ctx.engine.engine.eos_token_ids)
    except ValueError as e:  # a width past what a step can score
        raise bad_request(str(e), "beam_width") from None
    request_id = new_id("cmpl")
    created = int(time.time())
    step = 0
    while not search.done:
        batch = search.batch()
        streams = await add_requests(ctx, f"{request_id}-s{step}", batch, search.step_params,
                                     prompt_ids=batch, priority=req.priority)
        search.advance(await collect_final(streams))
        step += 1
    choices = []
    completion_tokens = 0
    for p, out in enumerate(search.results(ctx.tokenizer)):
        for rank, seq in enumerate(out.sequences[:n]):
            completion_tokens += len(seq.token_ids)
            choices.append({"index": p * n + rank, "text": seq.text, "logprobs": None,
                            "finish_reason": seq.finish_reason, "stop_reason": None})
    return {"id": request_id, "object": "text_completion", "created": created,
            "model": ctx.model_name, "choices": choices,
            "usage": usage(sum(len(i) for i in ids), completion_tokens)}
