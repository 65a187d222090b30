"""Batched token sampling: penalties -> greedy | temperature -> top-k -> top-p -> min-p -> sample.

Logprobs are vLLM's default "raw" logprobs: log_softmax of the logits after penalties,
logit_bias and min_tokens bans, but before temperature and truncation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loom.core.sched_output import Logprobs
from loom.kernels.cpu_ops import argmax_rows
from loom.sample.penalties import apply_all

if TYPE_CHECKING:
    from loom.sample.metadata import SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per request, plus logprobs where the request asked for them."""

    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: list[Logprobs | None]  # per request; None unless SamplingParams.logprobs is set


class Sampler:
    """Stateless batch sampler; `sampler(logits, metadata)` is `sampler.forward(...)`."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [num_reqs, vocab] (not modified)."""
        assert logits.dim() == 2 and logits.size(0) == metadata.num_reqs
        modifies = not (metadata.all_greedy and metadata.no_penalties
                        and metadata.no_logit_bias and metadata.ban_rows is None
                        and metadata.allowed_mask is None)
        # [num_reqs, vocab] fp32; copied only when something below writes to it.
        logits = logits.to(torch.float32, copy=modifies)
        apply_all(logits, metadata)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]
        sampled = self.sample(logits, metadata)  # [num_reqs]
        logprobs: list[Logprobs | None] = [None] * metadata.num_reqs
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = _gather_logprobs(
                raw_logprobs, sampled, metadata.max_num_logprobs, metadata.num_logprobs
            )
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    __call__ = forward

    @staticmethod
    def argmax_tokens(logits: torch.Tensor) -> list[int]:
        """Each row's token for requests whose params are all `argmax_only`: the choice `forward`
        makes for them (the first max of the fp32 logits), without the batch metadata."""
        return argmax_rows(logits.to(torch.float32)).tolist()

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Token ids [num_reqs] int64 from already-penalized logits; may modify `logits`."""
        return Sampler.sample_keeping(logits, metadata)[0]

    @staticmethod
    def sample_keeping(logits: torch.Tensor, metadata: SamplingMetadata
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`sample`'s tokens, and the distribution its random rows were drawn from [num_reqs,
        vocab] (compute_probs': not normalised; None when every row is greedy)."""
        # max(dim).indices (the first of ties): in C for fp32 on the CPU (argmax_rows)
        greedy = argmax_rows(logits) if not metadata.all_random else None  # [num_reqs]
        if metadata.all_greedy:
            assert greedy is not None
            return greedy, None
        probs = compute_probs(logits, metadata)  # [num_reqs, vocab]
        sampled = random_sample(probs, metadata.generators)  # [num_reqs]
        if greedy is not None:
            assert metadata.greedy_mask is not None
            sampled = torch.where(metadata.greedy_mask, greedy, sampled)
        return sampled, probs


def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row is drawn from, from already-penalized `logits`
    [num_reqs, vocab] (modified): temperature, top-k, top-p, softmax, then min-p zeroes tokens
    (rows then sum to <= 1). Speculative verification scores drafts against the same."""
    assert metadata.temperature is not None
    logits.div_(metadata.temperature.unsqueeze(1))  # [num_reqs, vocab]
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = torch.softmax(logits, dim=-1)  # [num_reqs, vocab]
    if metadata.min_p is not None:
        probs = apply_min_p(probs, metadata.min_p)
    return probs


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    top_k: [num_reqs] int64 (vocab_size = off); top_p: [num_reqs] float32 (1.0 = off). One sort
    serves the whole batch. Top-p keeps the smallest set of most likely tokens whose probability
    sums to >= p (always at least one token). Tokens tied with the k-th largest logit are kept.
    """
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [num_reqs, vocab] each
    vocab = logits.size(1)
    if top_k is not None:
        kth_pos = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)  # [num_reqs, 1]
        kth_value = logits_sort.gather(1, kth_pos)  # [num_reqs, 1]
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)  # [num_reqs, vocab] ascending
        cum = probs_sort.cumsum(dim=-1)  # [num_reqs, vocab]
        # Drop the ascending prefix whose mass is <= 1 - p: what remains sums to >= p.
        drop = cum <= (1.0 - top_p).unsqueeze(1)  # [num_reqs, vocab]
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)  # [num_reqs, vocab]


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens with prob < min_p * (row's max prob); probs [num_reqs, vocab], in place."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [num_reqs, 1]
    return probs.masked_fill_(probs < threshold, 0.0)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample each row of `probs` [num_reqs, vocab] (need not be normalized) -> [num_reqs].

    Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i.
    A seeded row draws its q only from its own generator, so its token does not depend on the
    rest of the batch; unseeded rows share one draw from the default generator.
    """
    q = torch.empty_like(probs)  # [num_reqs, vocab]
    if len(generators) < probs.size(0):
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # Exp(1) draws can underflow to 0; keep 0-prob tokens at 0 instead of 0/0 = nan.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return argmax_rows(probs.div(q))  # [num_reqs]: argmax, as in Sampler.sample


def _gather_logprobs(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    max_num_logprobs: int,
    num_logprobs: list[int | None],
) -> list[Logprobs | None]:
    """Logprob and rank of token_ids[i] in row i, plus the row's top-N; one host sync."""
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (logprobs > token_lp).sum(dim=-1) + 1  # [num_rows]
    top_lp, top_ids = logprobs.topk(max_num_logprobs, dim=-1)  # [num_rows, max_num_logprobs]
    ids_l, lp_l, ranks_l = token_ids.tolist(), token_lp.squeeze(1).tolist(), ranks.tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    out: list[Logprobs | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        out.append(Logprobs(
            token_ids=[ids_l[i], *top_ids_l[i][:n]],
            logprobs=[lp_l[i], *top_lp_l[i][:n]],
            ranks=[ranks_l[i], *range(1, n + 1)],
        ))
    return out


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int
) -> list[Logprobs]:
    """Prompt logprobs: row i of `logits` [n, vocab] predicts `next_token_ids[i]` ([n] int64).

    Returns one `Logprobs` per row: the actual next token's logprob and rank, then the top
    `num_top`. Raw logits (no penalties), as vLLM does.
    """
    if logits.size(0) == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    out = _gather_logprobs(logprobs, next_token_ids.long(), num_top, [num_top] * logits.size(0))
    return [lp for lp in out if lp is not None]
