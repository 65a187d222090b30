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

A request with a prediction (OpenAI's predicted outputs: SamplingParams.prediction) drafts from
it instead, with or without --speculative-config: where its output's last tokens occur in the
prediction (prediction_match), the prediction's next tokens, up to `prediction_tokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from loom.config import ConfigError
from loom.core.spec_adaptive import (
    MAX_MATCH, MAX_PAUSE, Cost, MatchAcceptance, RequestAcceptance, StepCosts, StepPlan,
)

if TYPE_CHECKING:
    import torch

    from loom.core.sched_output import SchedulerOutput
    from loom.request import Request

DEFAULT_ROW_COST = 0.3  # the prior cost of a verify row (docs/speculative.md)


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
    # one row; 0: k drafts in any batch. None: the engine's measured step times, this prior
    # (DEFAULT_ROW_COST) until measured (loom.core.spec_adaptive).
    row_cost: float | None = None

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
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not 0.0 <= c <= 1.0):
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


def _suffix_ends(source: np.ndarray, tail: np.ndarray, min_n: int, max_n: int) -> np.ndarray:
    """Where in `source` the longest suffix n-gram of `tail` (max_n down to min_n tokens) ends,
    ascending indices; empty when none occurs. An occurrence's last token sits at the index
    (the caller leaves out of `source` what must not end one)."""
    ends = np.flatnonzero(source == tail[-1])
    found = ends if min_n <= 1 else ends[:0]
    for i in range(1, min(max_n, len(tail))):  # narrowed to the suffix i + 1 tokens long
        ends = ends[ends >= i]
        ends = ends[source[ends - i] == tail[-1 - i]]
        if not len(ends):
            break
        if i + 1 >= min_n:
            found = ends
    return found


def _match_length(source: np.ndarray, end: int, tail: np.ndarray) -> int:
    """How many tokens agree backwards from source[end] and tail's last, up to MAX_MATCH."""
    length = 1
    while (length < MAX_MATCH and end >= length and length < len(tail)
           and source[end - length] == tail[-1 - length]):
        length += 1
    return length


def ngram_match(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """Prompt lookup: the latest earlier occurrence of the longest suffix n-gram (max_n down to
    min_n) of `tokens`, as (the index of the token after it, the match length: how many tokens
    agree backwards from it, up to MAX_MATCH, n or more); (-1, 0) when none occurs."""
    num = len(tokens)
    if num < min_n + 1:
        return -1, 0
    arr = np.asarray(tokens, dtype=np.int64)
    found = _suffix_ends(arr[: num - 1], arr, min_n, max_n)  # never the suffix itself
    if not len(found):
        return -1, 0
    end = int(found[-1])
    return end + 1, _match_length(arr, end, arr)


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of `tokens` (ngram_match); [] when none occurs."""
    start, _ = ngram_match(tokens, min_n, max_n) if k > 0 else (-1, 0)
    return [] if start < 0 else tokens[start: start + k]


# A prediction's drafts: the longest suffix n-gram of the output looked up in it (up to this
# long); the match length its first tokens are taken at before the output has any (a prediction
# usually starts as the output does: MatchAcceptance's 8-15 bucket).
PREDICTION_NGRAM = 8
START_MATCH = 8


def prediction_match(pred: np.ndarray, out: list[int], expect: int) -> tuple[int, int]:
    """Where the output `out` goes on in the prediction `pred`: (the index in pred of the token
    after the longest suffix n-gram of out (PREDICTION_NGRAM down to 1) found in pred, the match
    length: tokens agreeing backwards, up to MAX_MATCH), of the occurrences the first at or
    after `expect` (where the last draft would have led), else the last before it. (0,
    START_MATCH) for an empty output; (-1, 0) when the n-gram occurs nowhere or only at pred's
    end."""
    size = len(pred)
    if not out:
        return (0, START_MATCH) if size else (-1, 0)
    if size < 2:
        return -1, 0
    tail = np.asarray(out[-MAX_MATCH:], dtype=np.int64)
    found = _suffix_ends(pred[: size - 1], tail, 1, PREDICTION_NGRAM)  # a token must follow
    if not len(found):
        return -1, 0
    at = int(np.searchsorted(found, expect - 1))
    end = int(found[at] if at < len(found) else found[-1])
    length = _match_length(pred, end, tail)
    if length == len(out) and end + 1 == length:  # the output so far is the prediction's start
        length = max(length, START_MATCH)
    return end + 1, length


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

    def probs(self, req_id: str) -> torch.Tensor | None:
        """The distributions the request's last draft was drawn from [k, vocab] (None: a
        greedy draft)."""

    def drop(self, req_id: str) -> None: ...


class SpecDecoder:
    """Proposes drafts for the scheduler and adapts their length per request and per step
    (loom.core.spec_adaptive). With a drafter (method "draft_model"), `prepare` runs it once
    per step for every request that may decode with a draft (batched), before the scheduler
    asks `propose` per request. The engine reports each step's time (`observe_step`).
    A request with a prediction drafts up to `prediction_tokens` from it (config's k if None);
    `predictions_only`: no other request drafts (the engine has no --speculative-config)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 drafter: Drafter | None = None, *, prediction_tokens: int | None = None,
                 predictions_only: bool = False) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.prediction_tokens = prediction_tokens or config.num_speculative_tokens
        self.predictions_only = predictions_only
        self.stats = SpecDecodeStats()
        self.acceptance = MatchAcceptance()
        self.prediction_acceptance = MatchAcceptance()  # predictions' drafts, kept apart
        # req_id -> (where its last prediction draft started, its output tokens then)
        self._expect: dict[str, tuple[int, int]] = {}
        row_cost = DEFAULT_ROW_COST if config.row_cost is None else config.row_cost
        self.costs = StepCosts(row_cost)
        self._adaptive: dict[str, RequestAcceptance] = {}
        # req_id -> the acceptance table and match length of its n-gram or prediction draft
        self._matches: dict[str, tuple[MatchAcceptance, int]] = {}
        self._drafts: dict[str, list[int]] = {}
        self._plan = StepPlan(1)
        self._cost: Cost = self.costs.prior
        self._active = True  # whether this step may draft (prepare)

    def prepare(self, running: list[Request]) -> None:
        """Start a step: its plan, and draft-model drafts for its decoding requests."""
        self._drafts = {}
        self._matches = {}
        self._plan = StepPlan(len(running))
        self._active = not self.predictions_only or any(
            r.prediction is not None for r in running)
        if not self._active:
            return
        self._cost = self.costs.prior if self.config.row_cost is not None else (
            self.costs.measured())
        if self.drafter is None or self._off(len(running)):
            return
        reqs, ks = [], []
        trial = StepPlan(len(running))
        for r in running:
            if (r.num_tokens - r.num_computed_tokens != 1 or not can_speculate(r)
                    or r.prediction is not None):
                continue
            state = self._state(r)
            if state.pause or self._worthless(state):
                continue
            chances = self._alpha_chances(state, self._limit(r, self.config.num_speculative_tokens))
            k = self._length(state, chances, trial)
            if k > 0:
                trial.add(chances[:k])
                reqs.append(r)
                ks.append(k)
        if reqs:
            self._drafts = self.drafter.propose(reqs, ks)

    def observe_step(self, so: SchedulerOutput, seconds: float) -> None:
        """A step's time, from the engine: counted by rows when every request of it decoded
        (its last token and its draft); not kept where nothing plans with it (row_cost set, or
        adaptive off)."""
        if self.config.row_cost is not None or not self.config.adaptive or not self._active:
            return  # (nor while no request of a predictions-only decoder has one)
        drafts = so.scheduled_spec_decode_tokens
        if so.lookahead or so.scheduled_new_reqs or not so.num_scheduled_tokens or any(
                n != 1 + len(drafts.get(r, ())) for r, n in so.num_scheduled_tokens.items()):
            return
        self.costs.observe(so.total_num_scheduled_tokens, seconds)

    def _off(self, num_running: int) -> bool:
        """No request speculates in a batch this large."""
        limit = self.config.disable_by_batch_size
        return limit is not None and num_running > limit

    def _state(self, request: Request) -> RequestAcceptance:
        state = self._adaptive.get(request.request_id)
        if state is None:
            # a seeded sampled request's draws depend on its draft lengths: it plans with the
            # prior costs alone (reproducible whatever the timings)
            params = request.sampling_params
            state = self._adaptive[request.request_id] = RequestAcceptance(
                prior_costs=params.seed is not None and not params.greedy)
        return state

    def _limit(self, request: Request, k: int) -> int:
        """k, but never past max_tokens (the sampled token comes on top) nor max_model_len."""
        k = min(k, self.max_model_len - request.num_tokens)
        if request.max_tokens is not None:
            k = min(k, request.max_tokens - request.num_output_tokens - 1)
        return max(k, 0)

    def _cost_of(self, state: RequestAcceptance) -> Cost:
        """The step costs a request plans with (RequestAcceptance.prior_costs)."""
        return self.costs.prior if state.prior_costs else self._cost

    def _row_cost(self, state: RequestAcceptance) -> float:
        """A second row's cost, as a fraction of a one-row step, by the costs `state` plans
        with: the acceptance a draft must beat to be worth anything."""
        cost = self._cost_of(state)
        return cost(2) / cost(1) - 1.0

    @staticmethod
    def _alpha_chances(state: RequestAcceptance, k: int) -> list[float]:
        alpha = state.alpha
        return [alpha ** j for j in range(1, k + 1)]

    def _length(self, state: RequestAcceptance, chances: list[float], plan: StepPlan) -> int:
        """This step's draft length for a request (<= len(chances)): with `adaptive`, what its
        chances make worth the rows in this step (a probe: at least 1)."""
        if not chances or not self.config.adaptive:
            return len(chances)
        n = plan.length(chances, self._cost_of(state))
        return max(n, 1) if state.probe else n

    def _worthless(self, state: RequestAcceptance) -> bool:
        """Whether even alone in its step a request's drafts cost more than they yield (its
        acceptance at most a second row's cost)."""
        if not self.config.adaptive or state.probe:
            return False
        return state.alpha <= self._row_cost(state)

    def draft_probs(self, req_id: str, n: int) -> torch.Tensor | None:
        """Where a draft model sampled the request's draft this step, the distributions its
        first n tokens were drawn from [n, vocab]; None for point masses."""
        if self.drafter is None or req_id not in self._drafts:
            return None
        probs = self.drafter.probs(req_id)
        return None if probs is None else probs[:n]

    def propose(self, request: Request, num_running: int, token_budget: int) -> list[int]:
        """Draft tokens for a request about to decode its last token (maybe []). `token_budget`:
        the step's budget left after that token."""
        predicted = request.prediction is not None
        if ((self.predictions_only and not predicted) or self._off(num_running)
                or not can_speculate(request)):
            return []
        state = self._state(request)
        if state.pause > 0:
            state.pause -= 1
            state.probe = state.pause == 0
            return []
        if self._worthless(state):  # pause; then measure again
            state.pause, state.backoff = state.backoff, min(2 * state.backoff, MAX_PAUSE)
            return []
        most = self.prediction_tokens if predicted else self.config.num_speculative_tokens
        k = self._limit(request, min(most, token_budget))
        if k <= 0:
            return []
        if predicted:
            draft, chances = self._from_prediction(request, k, state)
        elif self.drafter is not None:
            chances = self._alpha_chances(state, k)
            draft = self._drafts.get(request.request_id, [])[: self._length(
                state, chances, self._plan)]
        else:
            cfg = self.config
            tokens = request.all_token_ids
            start, match = ngram_match(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if start < 0:
                return []
            chances = self.acceptance.chances(match, min(k, len(tokens) - start))
            draft = tokens[start: start + self._length(state, chances, self._plan)]
            self._matches[request.request_id] = (self.acceptance, match)
        if draft and request.grammar is not None:  # up to the first token it forbids
            draft = draft[: request.grammar.num_valid(draft)]
        self._plan.add(chances[: len(draft)])
        return draft

    def _from_prediction(self, request: Request, k: int, state: RequestAcceptance
                         ) -> tuple[list[int], list[float]]:
        """Up to k draft tokens from the request's prediction, and their chances."""
        pred = request.prediction
        assert pred is not None
        out = request.output_token_ids
        start, then = self._expect.get(request.request_id, (0, 0))
        start, match = prediction_match(pred, out, start + len(out) - then)
        if start < 0:
            return [], []
        chances = self.prediction_acceptance.chances(match, min(k, len(pred) - start))
        draft = pred[start: start + self._length(state, chances, self._plan)].tolist()
        self._expect[request.request_id] = (start, len(out))
        self._matches[request.request_id] = (self.prediction_acceptance, match)
        return draft, chances

    def on_verified(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        matched = self._matches.pop(req_id, None)
        if matched is not None:
            table, match = matched
            table.update(match, num_proposed, num_accepted)
        state = self._adaptive.get(req_id)
        if state is None:
            return
        state.update(num_proposed, num_accepted)
        state.probe = False
        if state.alpha > self._row_cost(state):
            state.backoff = 1

    @property
    def reported(self) -> bool:
        """Whether the counters are worth showing (/metrics, bench): speculation was asked for,
        or a request's prediction drafted."""
        return not self.predictions_only or self.stats.num_drafts > 0

    def drop(self, req_id: str) -> None:
        """Forget a request that finished, was aborted or failed (a preempted one keeps its
        state: it comes back)."""
        self._adaptive.pop(req_id, None)
        self._matches.pop(req_id, None)
        self._expect.pop(req_id, None)
        if self.drafter is not None:
            self.drafter.drop(req_id)
