"""Verification of speculative drafts: greedy (the target's argmax) and rejection sampling.

For a draft token d proposed with probability q(d) the target accepts it with probability
min(1, p(d) / q(d)); on rejection it samples from the residual max(p - q, 0), normalised
(Leviathan et al., 2023), so every emitted token is distributed as p alone would give it. An
n-gram proposal is a point mass (q(d) = 1): accept with probability p(d), and on rejection sample
p with d removed. After k accepted drafts one more token comes from the last row's p.
"""

from __future__ import annotations

import torch

from loom.kernels.cpu_ops import argmax_rows
from loom.sample.sampler import apply_min_p, apply_top_k_top_p


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """The distribution Sampler.sample draws from, per row of already-penalized `logits`
    [rows, vocab] (modified): temperature, top-k, top-p, softmax, min-p; rows sum to 1."""
    logits.div_(temperature.unsqueeze(1))
    logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)  # [rows, vocab]
    if min_p is not None:
        probs = apply_min_p(probs, min_p)
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
    idx = torch.tensor(draft, dtype=torch.long)
    rows = torch.arange(k)
    p_d = probs[rows, idx]  # [k]
    q_d = torch.ones(k) if q is None else q[rows, idx]
    u = torch.rand(k, generator=generator)
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


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """argmax per row (the first of ties), as Sampler.sample takes it."""
    return argmax_rows(logits).tolist()
