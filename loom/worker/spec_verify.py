"""Verification of speculative drafts in the runner (the scheduler's side: loom.core.spec_decode).

A request with a draft of k tokens ran 1 + k rows this step (its last real token, then the
draft); the logits of row i score draft token i (row k: the token after the whole draft). Each
row is sampled as if the draft tokens before it had been generated: penalties, logit_bias and
min_tokens bans see them as outputs. Greedy requests keep the target's argmax up to the first
disagreement (the exact tokens decoding one by one gives); sampled ones go through rejection
sampling (loom.sample.rejection), which leaves the output distribution unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from loom.sample.metadata import SamplingMetadata
from loom.sample.penalties import apply_all
from loom.sample.rejection import rejection_sample, target_probs, verify_greedy
from loom.sample.sampler import Sampler

if TYPE_CHECKING:
    from loom.sampling_params import SamplingParams


_SAMPLER = Sampler()  # stateless


class _State(Protocol):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None


def verify_draft(logits: torch.Tensor, state: _State, draft: list[int],
                 eos_token_ids: tuple[int, ...], vocab_size: int) -> list[int]:
    """The tokens one request emits this step: accepted drafts, then one of its own.
    logits [k + 1, vocab] (not modified)."""
    k = len(draft)
    assert logits.size(0) == k + 1
    params = state.sampling_params
    md = SamplingMetadata.build(
        [params] * (k + 1), [state.prompt_token_ids] * (k + 1),
        [state.output_token_ids + draft[:j] for j in range(k + 1)], [None] * (k + 1),
        eos_token_ids, vocab_size, logits.device)
    if params.greedy:  # the sampler's own tokens (it copies the logits only if it must)
        return verify_greedy(_SAMPLER.forward(logits, md).sampled_token_ids.tolist(), draft)
    logits = logits.to(torch.float32, copy=True)  # [k + 1, vocab]
    apply_all(logits, md)
    probs = target_probs(logits, md)
    return rejection_sample(probs, draft, generator=state.generator)

