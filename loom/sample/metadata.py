"""Per-step batch tensors for the sampler, built from the requests' `SamplingParams`.

`SamplingMetadata.build` runs once per engine step, so the common case (every request greedy,
no penalties, no bias, no logprobs) touches each request once in Python and builds no tensors
at all. Anything optional is `None` when no row in the batch uses it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

from loom.sampling_params import SamplingParamsError

if TYPE_CHECKING:
    from loom.sampling_params import SamplingParams


def check_token_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Raise `SamplingParamsError` if `logit_bias`, `stop_token_ids`, `allowed_token_ids` or
    `bad_words_token_ids` name a token >= vocab_size.

    `SamplingParams` cannot check this itself (it knows no vocabulary); the engine should call
    this when a request arrives so a bad id is rejected before it reaches a batch.
    """
    _check_ids("logit_bias", params.logit_bias or (), vocab_size)
    _check_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    _check_ids("allowed_token_ids", params.allowed_token_ids or (), vocab_size)
    for word in params.bad_words_token_ids or ():
        _check_ids("bad_words_token_ids", word, vocab_size)


def _check_ids(name: str, ids: Iterable[int], vocab_size: int) -> None:
    top = max(ids, default=-1)  # max(): C speed over a list as long as the vocabulary
    if top >= vocab_size:
        raise SamplingParamsError(
            name, f"{name} token id {top} is out of range (vocab_size {vocab_size})")


def _allowed_ids(params: SamplingParams, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A request's allowed_token_ids as a tensor on `device`, made once a request: a list of
    the whole vocabulary (or more, repeated) would otherwise cost every step ~20 ms."""
    cached = params.__dict__.get("_allowed_ids")
    if cached is None or cached.device != device:
        _check_ids("allowed_token_ids", params.allowed_token_ids or (), vocab_size)
        ids = sorted(set(params.allowed_token_ids or ()))
        cached = params.__dict__["_allowed_ids"] = torch.tensor(ids, dtype=torch.long,
                                                                device=device)
    return cached


def _token_counts(
    token_ids: list[list[int]], num_reqs: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Per-row token histogram [num_reqs, vocab_size] int32, built with one scatter_add."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)  # [num_reqs]
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long)  # [total]
    rows = torch.repeat_interleave(torch.arange(num_reqs), lengths)  # [total]
    index = (rows * vocab_size + flat).to(device)  # [total] flat index into counts
    counts = torch.zeros(num_reqs * vocab_size, dtype=torch.int32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return counts.view(num_reqs, vocab_size)  # [num_reqs, vocab_size]


@dataclass(slots=True)
class SamplingMetadata:
    """Sampling state for one batch; row i belongs to the i-th request given to `build`."""

    num_reqs: int
    all_greedy: bool
    all_random: bool
    # [num_reqs] bool: temperature == 0 or top_k == 1. None when all_greedy or all_random.
    greedy_mask: torch.Tensor | None
    # [num_reqs] float32, greedy rows set to 1.0 so division is safe. None when all_greedy.
    temperature: torch.Tensor | None
    # [num_reqs] int64, vocab_size where off. None when no random row uses top-k.
    top_k: torch.Tensor | None
    # [num_reqs] float32, 1.0 where off. None when no random row uses top-p.
    top_p: torch.Tensor | None
    # [num_reqs] float32, 0.0 where off. None when no random row uses min-p.
    min_p: torch.Tensor | None
    # Row index -> that request's generator, for random (non-greedy) seeded rows only.
    generators: dict[int, torch.Generator]

    no_penalties: bool
    # [num_reqs] float32 each; None when no_penalties.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [num_reqs, vocab] int32 counts of output tokens; None when no_penalties.
    output_token_counts: torch.Tensor | None
    # [num_reqs, vocab] bool, token occurs in the prompt; None when no repetition penalty.
    prompt_token_mask: torch.Tensor | None

    no_logit_bias: bool
    # Sparse bias as parallel [num_bias] tensors (row, token, value); None when no_logit_bias.
    logit_bias_rows: torch.Tensor | None
    logit_bias_tokens: torch.Tensor | None
    logit_bias_values: torch.Tensor | None

    # min_tokens and bad_words bans as parallel [num_bans] tensors (row, token); None when
    # nothing is banned.
    ban_rows: torch.Tensor | None
    ban_tokens: torch.Tensor | None
    # [num_reqs, vocab] bool: the tokens each row may sample (allowed_token_ids; every token
    # in rows without it); None when no row has allowed_token_ids.
    allowed_mask: torch.Tensor | None

    # Largest `logprobs` in the batch (None: no row wants logprobs); per-row values.
    max_num_logprobs: int | None
    num_logprobs: list[int | None]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Gather per-request parameters into batch tensors on `device`.

        All lists are parallel, one entry per request (row). `output_token_ids` are the tokens
        generated so far (used for penalties and min_tokens). `generators[i]` seeds row i when
        that request has a seed (it must live on `device`); rows with None share the default
        generator. Raises `SamplingParamsError` for a logit_bias / stop token id >= vocab_size.
        """
        num_reqs = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_reqs
        num_logprobs = [p.logprobs for p in params]
        present = [n for n in num_logprobs if n is not None]
        return cls(
            num_reqs=num_reqs,
            **_sampling_fields(params, generators, vocab_size, device),
            **_penalty_fields(params, prompt_token_ids, output_token_ids, vocab_size, device),
            **_sparse_fields(params, output_token_ids, eos_token_ids, vocab_size, device),
            max_num_logprobs=max(present) if present else None,
            num_logprobs=num_logprobs,
        )


def _f32(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _sampling_fields(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """Greedy flags, temperature, top-k/top-p/min-p and generators of the random rows."""
    greedy = [p.greedy for p in params]
    fields: dict[str, Any] = dict(
        all_greedy=all(greedy), all_random=not any(greedy), greedy_mask=None, temperature=None,
        top_k=None, top_p=None, min_p=None, generators={},
    )
    if fields["all_greedy"]:
        return fields
    if not fields["all_random"]:
        fields["greedy_mask"] = torch.tensor(greedy, dtype=torch.bool, device=device)
    # Greedy rows get neutral values so the batched ops are no-ops on them.
    rows = list(zip(params, greedy))
    fields["temperature"] = _f32([1.0 if g else p.temperature for p, g in rows], device)
    # A top_k of at least the vocabulary keeps every token: off (vLLM clamps it the same way).
    if any(0 < p.top_k < vocab_size and not g for p, g in rows):
        fields["top_k"] = _i64([p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size
                                for p, g in rows], device)
    if any(p.top_p < 1.0 and not g for p, g in rows):
        fields["top_p"] = _f32([1.0 if g else p.top_p for p, g in rows], device)
    if any(p.min_p > 0.0 and not g for p, g in rows):
        fields["min_p"] = _f32([0.0 if g else p.min_p for p, g in rows], device)
    fields["generators"] = {
        i: gen for i, (gen, g) in enumerate(zip(generators, greedy)) if gen is not None and not g
    }
    return fields


def _penalty_fields(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """Penalty values and the token histograms they need (only when some row is penalized)."""
    penalized = [
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        for p in params
    ]
    fields: dict[str, Any] = dict(
        no_penalties=not any(penalized), presence_penalties=None, frequency_penalties=None,
        repetition_penalties=None, output_token_counts=None, prompt_token_mask=None,
    )
    if fields["no_penalties"]:
        return fields
    num_reqs = len(params)
    fields["presence_penalties"] = _f32([p.presence_penalty for p in params], device)
    fields["frequency_penalties"] = _f32([p.frequency_penalty for p in params], device)
    fields["repetition_penalties"] = _f32([p.repetition_penalty for p in params], device)
    # Only penalized rows contribute tokens; the other rows stay all-zero (a no-op).
    outs = [ids if on else [] for ids, on in zip(output_token_ids, penalized)]
    fields["output_token_counts"] = _token_counts(outs, num_reqs, vocab_size, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [ids if p.repetition_penalty != 1.0 else []
                   for ids, p in zip(prompt_token_ids, params)]
        fields["prompt_token_mask"] = _token_counts(prompts, num_reqs, vocab_size, device) > 0
    return fields


def _sparse_fields(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """logit_bias entries, min_tokens and bad_words bans as (row, token[, value]) index
    tensors, and the allowed_token_ids mask."""
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            _check_ids("logit_bias", p.logit_bias, vocab_size)
            bias_rows.extend([i] * len(p.logit_bias))
            bias_tokens.extend(p.logit_bias.keys())
            bias_values.extend(p.logit_bias.values())
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
            _check_ids("stop_token_ids", p.stop_token_ids, vocab_size)
            banned = sorted(set(eos_token_ids).union(p.stop_token_ids))
            ban_rows.extend([i] * len(banned))
            ban_tokens.extend(banned)
        for word in p.bad_words_token_ids or ():  # vLLM's NoBadWordsLogitsProcessor
            out = output_token_ids[i]
            if len(word) == 1 or (len(out) >= len(word) - 1
                                  and out[len(out) - len(word) + 1:] == word[:-1]):
                ban_rows.append(i)
                ban_tokens.append(word[-1])
    allowed = None
    if any(p.allowed_token_ids is not None for p in params):
        allowed = torch.ones(len(params), vocab_size, dtype=torch.bool, device=device)
        for i, p in enumerate(params):
            if p.allowed_token_ids is not None:
                allowed[i] = False
                allowed[i, _allowed_ids(p, vocab_size, device)] = True
    has_bias = bool(bias_rows)
    return dict(
        no_logit_bias=not has_bias,
        logit_bias_rows=_i64(bias_rows, device) if has_bias else None,
        logit_bias_tokens=_i64(bias_tokens, device) if has_bias else None,
        logit_bias_values=_f32(bias_values, device) if has_bias else None,
        ban_rows=_i64(ban_rows, device) if ban_rows else None,
        ban_tokens=_i64(ban_tokens, device) if ban_rows else None,
        allowed_mask=allowed,
    )
