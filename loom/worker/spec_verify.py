"""Verification of speculative drafts in the runner (the scheduler's side: loom.core.spec_decode).

A request with a draft of k tokens ran 1 + k rows this step (its last real token, then the
draft); the logits of row i score draft token i (row k: the token after the whole draft). Each
row is processed as if the draft tokens before it had been generated: its structured-output
mask is the grammar's after them, and penalties, logit_bias and min_tokens bans see them as
outputs. Greedy requests keep the target's argmax up to the first disagreement (the exact
tokens decoding one by one gives); sampled ones go through rejection sampling
(loom.sample.rejection), which leaves the output distribution unchanged. Each emitted token's
logprobs come from its own row, as the sampler reports them (after penalties, before
temperature).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from loom.sample.metadata import SamplingMetadata
from loom.sample.penalties import apply_all
from loom.sample.rejection import rejection_sample, target_probs, verify_greedy
from loom.sample.sampler import Sampler, compute_prompt_logprobs
from loom.structured.backend import apply_token_bitmask

if TYPE_CHECKING:
    from loom.core.sched_output import Logprobs
    from loom.sampling_params import SamplingParams


_SAMPLER = Sampler()  # stateless


class _State(Protocol):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None


def verify_draft(logits: torch.Tensor, state: _State, draft: list[int],
                 eos_token_ids: tuple[int, ...], vocab_size: int,
                 bitmask: torch.Tensor | None = None, q: torch.Tensor | None = None
                 ) -> tuple[list[int], list[Logprobs] | None]:
    """The tokens one request emits this step (accepted drafts, then one of its own) and, if it
    asked for them, their logprobs. logits [k + 1, vocab] (not modified); bitmask
    [k + 1, words]: the grammar's allowed tokens at each row (None: unconstrained); q [k, vocab]:
    the distribution each draft token was drawn from (a sampled draft model's; None: point
    masses)."""
    k = len(draft)
    assert logits.size(0) == k + 1
    params = state.sampling_params
    if params.argmax_only and bitmask is None:
        return verify_greedy(_SAMPLER.argmax_tokens(logits), draft), None
    md = SamplingMetadata.build(
        [params] * (k + 1), [state.prompt_token_ids] * (k + 1),
        [state.output_token_ids + draft[:j] for j in range(k + 1)], [None] * (k + 1),
        eos_token_ids, vocab_size, logits.device)
    if bitmask is not None:
        logits = logits.to(torch.float32, copy=True)  # [k + 1, vocab]
        apply_token_bitmask(logits, list(range(k + 1)), bitmask)
    if params.greedy:  # the sampler's own tokens (it copies the logits only if it must)
        out = _SAMPLER.forward(logits, md)
        tokens = verify_greedy(out.sampled_token_ids.tolist(), draft)
        # every emitted token is its row's argmax: the sampler's logprobs of that row
        return tokens, (None if params.logprobs is None else out.logprobs[: len(tokens)])
    logits = logits.to(torch.float32, copy=bitmask is None)  # [k + 1, vocab]
    apply_all(logits, md)
    # the logits the logprobs come from, before target_probs divides by the temperature
    raw = None if params.logprobs is None else logits.clone()  # [k + 1, vocab]
    tokens = rejection_sample(target_probs(logits, md), draft, q, generator=state.generator)
    if raw is None:
        return tokens, None
    targets = torch.tensor(tokens, device=raw.device)
    return tokens, compute_prompt_logprobs(raw[: len(tokens)], targets, params.logprobs)
