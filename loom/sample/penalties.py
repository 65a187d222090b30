"""Logit adjustments applied before sampling: penalties, logit_bias, bans and allowed tokens.

All functions work in place on `logits` [num_reqs, vocab] float32 and are vectorized over the
batch; each is a no-op (and costs nothing) when its part of the metadata is None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loom.sample.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM / OpenAI semantics), in place.

    - repetition (HF/CTRL): a token seen in the prompt OR the output has its logit divided by
      the penalty if positive, multiplied by it otherwise.
    - frequency: subtract penalty * (times the token occurs in the OUTPUT).
    - presence: subtract penalty * (token occurs in the OUTPUT at all).
    """
    if metadata.no_penalties:
        return logits
    counts = metadata.output_token_counts
    assert counts is not None and metadata.repetition_penalties is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    output_mask = counts > 0  # [num_reqs, vocab]
    if metadata.prompt_token_mask is not None:
        seen = metadata.prompt_token_mask | output_mask  # [num_reqs, vocab]
        rep = metadata.repetition_penalties.unsqueeze(1)  # [num_reqs, 1]
        penalty = torch.where(seen, rep, torch.ones_like(rep))  # [num_reqs, vocab]
        logits.mul_(torch.where(logits > 0, penalty.reciprocal(), penalty))
    logits.sub_(metadata.frequency_penalties.unsqueeze(1) * counts)  # [num_reqs, vocab]
    logits.sub_(metadata.presence_penalties.unsqueeze(1) * output_mask)  # [num_reqs, vocab]
    return logits


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add each request's `logit_bias` values to its row, in place."""
    if metadata.no_logit_bias:
        return logits
    assert metadata.logit_bias_rows is not None and metadata.logit_bias_tokens is not None
    assert metadata.logit_bias_values is not None
    logits.index_put_(
        (metadata.logit_bias_rows, metadata.logit_bias_tokens),
        metadata.logit_bias_values,
        accumulate=True,
    )
    return logits


def apply_min_tokens_bans(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set the banned tokens' logits to -inf, in place: EOS and stop tokens of requests still
    below `min_tokens`, and bad_words' tokens."""
    if metadata.ban_rows is None:
        return logits
    assert metadata.ban_tokens is not None
    logits[metadata.ban_rows, metadata.ban_tokens] = float("-inf")
    return logits


def apply_allowed(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """-inf for every token outside a row's allowed_token_ids, in place. Where the bans left
    none of a row's allowed tokens, they come back at equal logits (a choice among them rather
    than a row of -inf, which has no distribution)."""
    allowed = metadata.allowed_mask
    if allowed is None:
        return logits
    logits.masked_fill_(~allowed, float("-inf"))
    dead = torch.isneginf(logits).all(dim=-1)  # [num_reqs]
    if bool(dead.any()):
        logits[dead] = torch.where(allowed[dead], 0.0, float("-inf"))
    return logits


def apply_all(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Penalties, then logit_bias, then the bans (min_tokens, bad_words) and allowed_token_ids
    (last, so no bias can undo them)."""
    apply_penalties(logits, metadata)
    apply_logit_bias(logits, metadata)
    apply_min_tokens_bans(logits, metadata)
    apply_allowed(logits, metadata)
    return logits
