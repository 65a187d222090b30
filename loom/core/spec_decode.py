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
    adaptive: bool = True  # draft length per request and step: its acceptance, the batch
    # With `adaptive`: the cost of one more row in a verify step, as a fraction of a step of
    # one row (docs/speculative.md: measured on the default model; lower where reading the
    # weights bounds a step); 0: k drafts in any batch.
    row_cost: float = 0.3

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
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config adaptive must be true or false, got "
                              f"{self.adaptive!r}")
        c = self.row_cost
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
            raise ConfigError(f"speculative_config row_cost must be a number in [0, 1], got "
                              f"{c!r}")
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
        if "row_cost" in value and value.get("adaptive") is False:
            raise ConfigError("speculative_config row_cost applies to the adaptive draft "
                              "length only (adaptive is false)")
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


# A request's acceptance estimate starts at PRIOR_HITS / (PRIOR_HITS + PRIOR_MISSES) and each
# verify step's evidence weighs DECAY times the step's before (a reply moves between quoting
# and writing its own words).
PRIOR_HITS, PRIOR_MISSES, DECAY = 4.0, 1.0, 0.7
MAX_PAUSE = 32  # steps


@dataclass(slots=True)
class _Adaptive:
    """One request's draft acceptance: each verify step that accepted a of n draft tokens
    counts a hits and, when a < n, one miss (the token rejected), older steps decayed. The
    model: each draft token is accepted with probability alpha = hits / (hits + misses) once
    the ones before it were. When no draft is worth its rows the request pauses 1, 2, 4 ... 32
    steps, then drafts one token (a probe) to measure again."""

    hits: float = PRIOR_HITS
    misses: float = PRIOR_MISSES
    pause: int = 0
    backoff: int = 1
    probe: bool = False

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def update(self, num_proposed: int, num_accepted: int) -> None:
        self.hits = DECAY * self.hits + num_accepted
        self.misses = DECAY * self.misses + (num_accepted < num_proposed)


class _StepPlan:
    """A step's expected tokens and cost (in one-row steps), as drafts are added: a draft's
    j-th token is worth one more row when its chance alpha^j beats the tokens a unit of cost
    the step yields so far, times a row's cost (so one more row raises the step's rate). A
    step of B decoding requests yields B tokens for 1 + row_cost (B - 1): the larger the batch,
    the surer a draft token must be."""

    def __init__(self, num_running: int, row_cost: float) -> None:
        self.row_cost = row_cost
        self.tokens = float(max(num_running, 1))
        self.cost = 1.0 + row_cost * (self.tokens - 1.0)

    def length(self, alpha: float, k: int) -> int:
        """The most draft tokens (<= k) worth their rows at acceptance alpha."""
        tokens, cost, p = self.tokens, self.cost, 1.0
        for j in range(k):
            p *= alpha
            if p <= self.row_cost * tokens / cost:
                return j
            tokens += p
            cost += self.row_cost
        return k

    def add(self, alpha: float, n: int) -> None:
        """Count a draft of n tokens in the step."""
        p = 1.0
        for _ in range(n):
            p *= alpha
            self.tokens += p
            self.cost += self.row_cost


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
    """Proposes drafts for the scheduler and adapts their length per request and per step
    (`_Adaptive`, `_StepPlan`). With a drafter (method "draft_model"), `prepare` runs it once
    per step for every request that may decode with a draft (batched), before the scheduler
    asks `propose` per request."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.stats = SpecDecodeStats()
        self._adaptive: dict[str, _Adaptive] = {}
        self._drafts: dict[str, list[int]] = {}
        self._plan = _StepPlan(1, config.row_cost)

    def prepare(self, running: list[Request]) -> None:
        """Start a step: its plan, and draft-model drafts for its decoding requests."""
        self._drafts = {}
        self._plan = _StepPlan(len(running), self.config.row_cost)
        if self.drafter is None or self._off(len(running)):
            return
        reqs, ks = [], []
        trial = _StepPlan(len(running), self.config.row_cost)
        for r in running:
            if r.num_tokens - r.num_computed_tokens != 1 or not can_speculate(r):
                continue
            state = self._state(r)
            k = 0 if state.pause or self._worthless(state) else self._length(
                r, state, self.config.num_speculative_tokens, trial)
            if k > 0:
                trial.add(state.alpha, k)
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
            state = self._adaptive[request.request_id] = _Adaptive()
        return state

    def _limit(self, request: Request, k: int) -> int:
        """k, but never past max_tokens (the sampled token comes on top) nor max_model_len."""
        k = min(k, self.max_model_len - request.num_tokens)
        if request.max_tokens is not None:
            k = min(k, request.max_tokens - request.num_output_tokens - 1)
        return k

    def _length(self, request: Request, state: _Adaptive, k: int, plan: _StepPlan) -> int:
        """This step's draft length for a request (<= k): with `adaptive`, what its acceptance
        makes worth the rows in this step (a probe: at least 1)."""
        k = self._limit(request, k)
        if k <= 0 or not self.config.adaptive:
            return k
        n = plan.length(state.alpha, k)
        return max(n, 1) if state.probe else n

    def _worthless(self, state: _Adaptive) -> bool:
        """Whether even alone in its step a request's drafts cost more than they yield."""
        return self.config.adaptive and not state.probe and state.alpha <= self.config.row_cost

    def propose(self, request: Request, num_running: int, token_budget: int) -> list[int]:
        """Draft tokens for a request about to decode its last token (maybe []). `token_budget`:
        the step's budget left after that token."""
        if self._off(num_running) or not can_speculate(request):
            return []
        state = self._state(request)
        if state.pause > 0:
            state.pause -= 1
            state.probe = state.pause == 0
            return []
        if self._worthless(state):  # pause; then measure again
            state.pause, state.backoff = state.backoff, min(2 * state.backoff, MAX_PAUSE)
            return []
        k = self._length(request, state, min(self.config.num_speculative_tokens, token_budget),
                         self._plan)
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
        self._plan.add(state.alpha, len(draft))
        return draft

    def on_verified(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        state = self._adaptive.get(req_id)
        if state is None:
            return
        state.update(num_proposed, num_accepted)
        state.probe = False
        if state.alpha > self.config.row_cost:
            state.backoff = 1

    def drop(self, req_id: str) -> None:
        """Forget a request that finished, was aborted or failed (a preempted one keeps its
        state: it comes back)."""
        self._adaptive.pop(req_id, None)
        if self.drafter is not None:
            self.drafter.drop(req_id)
