"""Verification of speculative drafts: greedy (the target's argmax) and rejection sampling.

For a draft token d proposed with probability q(d) the target accepts it with probability
min(1, p(d) / q(d)); on rejection it samples from the residual max(p - q, 0), normalised
(Leviathan et al., 2023), so every emitted token is distributed as p alone would give it. An
n-gram proposal is a point mass (q(d) = 1): accept with probability p(d), and on rejection sample
p with d removed. After k accepted drafts one more token comes from the last row's p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loom.sample.sampler import compute_probs

if TYPE_CHECKING:
    from loom.sample.metadata import SamplingMetadata


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution Sampler.sample draws from, per row of already-penalized `logits`
    [rows, vocab] (modified), normalised: rows sum to 1."""
    return normalise_(compute_probs(logits, metadata))  # [rows, vocab]


def normalise_(probs: torch.Tensor) -> torch.Tensor:
    """`probs` [rows, vocab] (compute_probs': positive, not normalised) with each row divided by
    its sum, in place."""
    return probs.div_(probs.sum(dim=-1, keepdim=True))


def verify_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """`argmax` [k + 1]: the target's token at each row. The drafts up to the first one it
    disagrees with, then its own token there (or after all k)."""
    out: list[int] = []
    for d, t in zip(draft, argmax):
        if d != t:
            break
        out.append(d)
    out.append(argmax[len(out)])
    return out


def rejection_sample(probs: torch.Tensor, draft: list[int], q: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """Accepted drafts plus one sampled token. probs [k + 1, vocab]: the target's distribution
    at each row (row i scores draft i; row k gives the bonus token). q [k, vocab]: the draft's
    distribution at each draft position, None for point masses on `draft`."""
    k = len(draft)
    assert probs.size(0) == k + 1
    device = probs.device  # (a request's generator lives on its runner's device, as do these)
    idx = torch.tensor(draft, dtype=torch.long, device=device)
    rows = torch.arange(k, device=device)
    p_d = probs[rows, idx]  # [k]
    q_d = torch.ones(k, device=device) if q is None else q[rows, idx]
    u = torch.rand(k, generator=generator, device=device)
    accepted = (u * q_d < p_d).tolist()  # u < p/q, without dividing by a q of 0
    num = accepted.index(False) if False in accepted else k
    if num == k:
        residual = probs[k]
    else:
        if q is None:
            residual = probs[num].clone()
            residual[draft[num]] = 0.0
        else:
            residual = (probs[num] - q[num]).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:  # rounding only: p(d) was ~1 yet rejected
            residual = probs[num]
    token = int(torch.multinomial(residual, 1, generator=generator))
    return [*draft[:num], token]

