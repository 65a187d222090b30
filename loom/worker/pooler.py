"""Embeddings: each embedding request's prompt hidden states pooled as it is computed.

A request whose SamplingParams set `pooling` runs through the scheduler like any other (chunked
prefill, batched with generation); after every step the runner hands this class its rows. "last"
takes the final-normed hidden state of the prompt's last token, "mean" the average over every
prompt token (such requests skip the prefix cache, so every token runs); both L2-normalised.
The embedding of a request whose prompt completed waits in `pooled` until the engine takes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


class _State(Protocol):
    req_id: str
    num_prompt_tokens: int

    @property
    def sampling_params(self): ...  # noqa: ANN201, D102 - SamplingParams


class Pooler:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}  # mean pooling: the prompt rows' running sum
        self.pooled: dict[str, list[float]] = {}  # finished embeddings, taken by the engine

    @staticmethod
    def needs_all_rows(states: Sequence[_State], computed: Sequence[int]) -> bool:
        """Whether a mean-pooling prompt runs this step (its every row is needed)."""
        return any(s.sampling_params.pooling == "mean" and c < s.num_prompt_tokens
                   for s, c in zip(states, computed))

    def step(
        self, states: Sequence[_State], computed: Sequence[int], num_sched: Sequence[int],
        ends: np.ndarray, hidden: torch.Tensor, rows: np.ndarray | None,
    ) -> None:
        """Pool this step's rows. `hidden` holds every row when `rows` is None, else only the
        rows `rows` names (ascending), in that order."""
        for i, s in enumerate(states):
            mode = s.sampling_params.pooling
            if mode is None or computed[i] >= s.num_prompt_tokens:
                continue
            end = int(ends[i])
            if mode == "mean":
                part = hidden[end - num_sched[i]: end].float().sum(0)  # [hidden]
                # computed 0: a first or preempted-and-restarted prefill
                before = self.sums.get(s.req_id) if computed[i] else None
                self.sums[s.req_id] = part if before is None else before + part
            if computed[i] + num_sched[i] < s.num_prompt_tokens:
                continue  # the prompt goes on in a later step
            if mode == "mean":
                vec = self.sums.pop(s.req_id) / s.num_prompt_tokens
            else:
                vec = hidden[end - 1 if rows is None else int(np.searchsorted(rows, end - 1))]
            self.pooled[s.req_id] = F.normalize(vec.float(), dim=-1).tolist()

    def drop(self, req_id: str) -> None:
        """Forget a request (finished or aborted)."""
        self.sums.pop(req_id, None)
        self.pooled.pop(req_id, None)
