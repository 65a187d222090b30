"""Speculative decoding, the scheduler's side: the n-gram (prompt-lookup) proposer, each
request's adaptive draft length, and the counters /metrics shows.

A decoding request with a proposal is scheduled for 1 + k tokens: its last real token and the k
proposed ones, scored in one step beside the other requests' prompt chunks and decodes (the k
count against the step's token budget). The runner verifies them (loom.worker.spec_verify) and
returns the accepted tokens plus one it sampled itself; the scheduler then rolls the rejected
tokens' KV slots back (num_computed_tokens, and blocks past them freed).

Everything a token passes through applies per draft position: penalties, logprobs and a
structured-output grammar (a draft is cut before the first token its grammar forbids; the
engine builds a mask per position). Pooling (embedding) requests do not speculate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from loom.config import ConfigError

if TYPE_CHECKING:
    from loom.request import Request


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config shape: method "ngram" (prompt lookup) or "draft_model" (a
    smaller model with the same vocabulary, `model`, run greedily with its own KV cache)."""

    method: str = "ngram"
    model: str | None = None  # the draft model (method "draft_model")
    num_speculative_tokens: int = 3  # k: the most tokens proposed per step
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up in the request's tokens
    prompt_lookup_min: int = 1  # shortest
    # No request speculates while more than this many run (the verify rows cost compute a
    # large batch no longer has to spare); None: any batch.
    disable_by_batch_size: int | None = 8
    adaptive: bool = True  # per request: shorter drafts after rejections, pauses after misses

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ConfigError(f"speculative_config method {self.method!r}: 'ngram' or "
                              "'draft_model'")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config: a model goes with method 'draft_model' "
                              "(and only with it)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"speculative_config {name} must be a positive integer, "
                                  f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("speculative_config prompt_lookup_min "
                              f"({self.prompt_lookup_min}) > prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ConfigError(f"speculative_config disable_by_batch_size must be a positive "
                              f"integer or null, got {b!r}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """From a JSON object (text or dict); None stays None. Unknown keys are refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown keys {unknown} (known: "
                              f"{sorted(known)})")
        if "method" not in value:
            raise ConfigError("speculative_config needs a method (\"ngram\" or "
                              "\"draft_model\")")
        return cls(**value)


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the longest
    suffix n-gram (max_n down to min_n) of `tokens`; [] when none occurs."""
    num = len(tokens)
    if k <= 0 or num < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = arr[num - n:]
        # windows start at 0 .. num-1-n: never the suffix itself, always a token after it
        windows = np.lib.stride_tricks.sliding_window_view(arr[: num - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start: start + k].tolist()
    return []


@dataclass(slots=True)
class _Adaptive:
    """One request's draft length: after a step that accepted a of k, the next drafts hold at
    most a + 1 tokens (k again after a full acceptance); after 2 steps in a row that accepted
    nothing the request pauses, 2, 4, ... up to 32 steps."""

    k: int
    misses: int = 0
    pause: int = 0
    backoff: int = 1


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counters (vLLM's spec_decode metric names, minus the prefix)."""

    num_drafts: int = 0  # verify steps
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # of those, accepted
    # accepted_per_pos[i]: drafts whose token i was accepted; proposed_per_pos[i]: drafts that
    # had a token i (acceptance rate at position i = their ratio)
    accepted_per_pos: list[int] = field(default_factory=list)
    proposed_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos), list(self.proposed_per_pos))

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        grow = num_proposed - len(self.proposed_per_pos)
        if grow > 0:
            self.proposed_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for i in range(num_proposed):
            self.proposed_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


def can_speculate(request: Request) -> bool:
    """Whether the runner verifies this request's proposals (see the module docstring)."""
    return request.sampling_params.pooling is None


class Drafter(Protocol):
    """A model that proposes drafts (loom.engine.draft_model), given by the engine."""

    def propose(self, requests: list[Request], num_tokens: list[int]) -> dict[str, list[int]]: ...

    def drop(self, req_id: str) -> None: ...


class SpecDecoder:
    """Proposes drafts for the scheduler and adapts their length per request. With a drafter
    (method "draft_model"), `prepare` runs it once per step for every request that may decode
    with a draft (batched), before the scheduler asks `propose` per request."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.stats = SpecDecodeStats()
        self._adaptive: dict[str, _Adaptive] = {}
        self._drafts: dict[str, list[int]] = {}

    def prepare(self, running: list[Request]) -> None:
        """Draft-model drafts for this step's decoding requests (no-op for n-gram)."""
        self._drafts = {}
        if self.drafter is None or self._off(len(running)):
            return
        reqs, ks = [], []
        for r in running:
            if r.num_tokens - r.num_computed_tokens != 1 or not can_speculate(r):
                continue
            state = self._state(r)
            k = 0 if state.pause else self._limit(r, state.k)
            if k > 0:
                reqs.append(r)
                ks.append(k)
        if reqs:
            self._drafts = self.drafter.propose(reqs, ks)

    def _off(self, num_running: int) -> bool:
        """No request speculates in a batch this large."""
        limit = self.config.disable_by_batch_size
        return limit is not None and num_running > limit

    def _state(self, request: Request) -> _Adaptive:
        state = self._adaptive.get(request.request_id)
        if state is None:
            state = self._adaptive[request.request_id] = _Adaptive(
                self.config.num_speculative_tokens)
        return state

    def _limit(self, request: Request, k: int) -> int:
        """k, but never past max_tokens (the sampled token comes on top) nor max_model_len."""
        k = min(k, self.max_model_len - request.num_tokens)
        if request.max_tokens is not None:
            k = min(k, request.max_tokens - request.num_output_tokens - 1)
        return k

    def propose(self, request: Request, num_running: int, token_budget: int) -> list[int]:
        """Draft tokens for a request about to decode its last token (maybe []). `token_budget`:
        the step's budget left after that token."""
        if self._off(num_running) or not can_speculate(request):
            return []
        state = self._state(request)
        if state.pause > 0:
            state.pause -= 1
            return []
        k = self._limit(request, min(state.k, token_budget))
        if k <= 0:
            return []
        if self.drafter is not None:
            draft = self._drafts.get(request.request_id, [])[:k]
        else:
            cfg = self.config
            draft = ngram_propose(request.all_token_ids, k, cfg.prompt_lookup_min,
                                  cfg.prompt_lookup_max)
        if draft and request.grammar is not None:  # up to the first token it forbids
            draft = draft[: request.grammar.num_valid(draft)]
        return draft

    def on_verified(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        state = self._adaptive.get(req_id)
        if state is None or not self.config.adaptive:
            return
        k_max = self.config.num_speculative_tokens
        state.k = k_max if num_accepted == num_proposed else min(k_max, num_accepted + 1)
        if num_accepted:
            state.misses, state.backoff = 0, 1
            return
        state.misses += 1
        if state.misses >= 2:
            state.pause, state.misses = state.backoff, 0
            state.backoff = min(2 * state.backoff, 32)

    def drop(self, req_id: str) -> None:
        """Forget a finished or preempted request."""
        self._adaptive.pop(req_id, None)
        if self.drafter is not None:
            self.drafter.drop(req_id)
