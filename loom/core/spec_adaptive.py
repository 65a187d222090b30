"""The adaptive draft length of speculative decoding (loom.core.spec_decode): how likely each
draft token is to be kept, what a step of a given number of rows costs, and so how many draft
tokens each request of a step gets.

- Acceptance (`MatchAcceptance`): an n-gram draft copies what followed an earlier occurrence of
  the request's last tokens; the longer that match (the tokens agreeing backwards from it, L),
  the likelier the copy goes on as the model would. A draft token at match length L (the
  draft's j-th token: L + j, its draft predecessors taken as matched) is kept with probability
  a(L), one estimate per bucket of L (1, 2, 3, 4, 5-7, 8-15, 16-31, 32+), shared by the
  requests: priors from the copy and chat workloads of benchmarks/bench_spec.py, then each
  verified token counts, older ones decayed. A draft model's drafts have no match length: a
  request's own acceptance (`RequestAcceptance.alpha`) is their chance a token.
- Cost (`StepCosts`): a step of r rows costs t(r): the median of the engine's last measured
  decode steps of r rows (greedy requests; `row_cost` unset), else 1 + row_cost (r - 1) times
  t(1). A request whose sampling is seeded plans with the latter alone, so its draft lengths,
  and with them its random draws, do not depend on timings.
- The plan (`StepPlan`): a step starts with its B decoding requests' B tokens and B rows; each
  request in the scheduler's order takes the draft length n <= k that maximises the step's
  expected tokens per unit of cost, (tokens + p_1 + ... + p_n) / t(rows + n), where p_j is the
  chance that draft tokens 1..j are all kept.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# A request's own acceptance starts at PRIOR_HITS / (PRIOR_HITS + PRIOR_MISSES) and each verify
# step's evidence weighs DECAY times the step's before (a reply moves between quoting and
# writing its own words).
PRIOR_HITS, PRIOR_MISSES, DECAY = 4.0, 1.0, 0.7
MAX_PAUSE = 32  # steps

# Match-length buckets (their lower bounds) and the prior chance that a draft token at that
# match length is kept (measured on bench_spec's outputs with SmolLM2-135M, greedy).
BUCKETS = (1, 2, 3, 4, 5, 8, 16, 32)
BUCKET_PRIOR = (0.2, 0.5, 0.6, 0.7, 0.85, 0.92, 0.97, 0.98)
PRIOR_WEIGHT = 8.0  # observations the prior counts as
TABLE_DECAY = 0.98  # per verified token of the bucket
MAX_MATCH = BUCKETS[-1]  # match lengths are measured up to this
MAX_CHANCE = 0.995  # no draft token is ever taken as certain

COST_WINDOW = 15  # measured steps kept per row count
COST_MIN_SAMPLES = 3  # before a row count's median replaces the prior


def bucket(match_len: int) -> int:
    """The index of the bucket of a match length (>= 1)."""
    return max(bisect.bisect_right(BUCKETS, match_len) - 1, 0)


class MatchAcceptance:
    """The chance a draft token is kept, by the match length it was copied at (shared)."""

    def __init__(self) -> None:
        self.hits = [p * PRIOR_WEIGHT for p in BUCKET_PRIOR]
        self.misses = [(1.0 - p) * PRIOR_WEIGHT for p in BUCKET_PRIOR]

    def chance(self, match_len: int) -> float:
        b = bucket(match_len)
        return self.hits[b] / (self.hits[b] + self.misses[b])

    def chances(self, match_len: int, n: int) -> list[float]:
        """p_1 .. p_n: the chance that draft tokens 1..j are all kept, the j-th copied at match
        length match_len + j - 1."""
        out, p = [], 1.0
        for j in range(n):
            p *= min(self.chance(match_len + j), MAX_CHANCE)
            out.append(p)
        return out

    def update(self, match_len: int, num_proposed: int, num_accepted: int) -> None:
        """Count a verified draft: its tokens up to the first rejected one."""
        for j in range(min(num_proposed, num_accepted + 1)):
            b = bucket(match_len + j)
            self.hits[b] = TABLE_DECAY * self.hits[b] + (j < num_accepted)
            self.misses[b] = TABLE_DECAY * self.misses[b] + (j >= num_accepted)


@dataclass(slots=True)
class RequestAcceptance:
    """One request's draft acceptance: each verify step that accepted a of n draft tokens
    counts a hits and, when a < n, one miss (the token rejected), older steps decayed. When no
    draft is worth its rows (alpha at most a row's cost) the request pauses 1, 2, 4 ... 32
    steps, then drafts one token (a probe) to measure again. `prior_costs`: the request plans
    with StepCosts.prior alone, never measured times (a seeded sampled request)."""

    hits: float = PRIOR_HITS
    misses: float = PRIOR_MISSES
    pause: int = 0
    backoff: int = 1
    probe: bool = False
    prior_costs: bool = False

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def update(self, num_proposed: int, num_accepted: int) -> None:
        self.hits = DECAY * self.hits + num_accepted
        self.misses = DECAY * self.misses + (num_accepted < num_proposed)


Cost = Callable[[int], float]  # rows -> a step's cost (any unit, compared within a step)


class StepCosts:
    """Measured seconds of decode steps by their rows (the engine reports them)."""

    def __init__(self, row_cost: float) -> None:
        self.row_cost = row_cost
        self._seconds: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}  # rows -> median, once COST_MIN_SAMPLES are kept

    def observe(self, rows: int, seconds: float) -> None:
        window = self._seconds.setdefault(rows, deque(maxlen=COST_WINDOW))
        window.append(seconds)
        if len(window) >= COST_MIN_SAMPLES:
            self._medians[rows] = statistics.median(window)

    def prior(self, rows: int) -> float:
        return 1.0 + self.row_cost * (rows - 1)

    def measured(self) -> Cost:
        """The cost function of the steps measured so far: between two measured row counts
        the line through them, past them the prior's shape from the nearest one, and the prior
        itself before any."""
        known = sorted(self._medians.items())
        if not known:
            return self.prior
        prior = self.prior

        def cost(rows: int) -> float:
            i = bisect.bisect_left(known, (rows, -1.0))
            if i < len(known) and known[i][0] == rows:
                return known[i][1]
            if i == 0 or i == len(known):  # outside the measured: scaled from the nearest
                r, t = known[0] if i == 0 else known[-1]
                return t * prior(rows) / prior(r)
            (r0, t0), (r1, t1) = known[i - 1], known[i]
            return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        return cost


class StepPlan:
    """A step's expected tokens and rows as drafts are added (see the module docstring)."""

    def __init__(self, num_running: int) -> None:
        self.tokens = float(max(num_running, 1))
        self.rows = max(num_running, 1)

    def length(self, chances: list[float], cost: Cost) -> int:
        """The draft length (<= len(chances)) that maximises the step's tokens per cost."""
        base = cost(self.rows)
        best, best_n, tokens = self.tokens / base, 0, self.tokens
        for n, p in enumerate(chances, 1):
            tokens += p
            rate = tokens / cost(self.rows + n)
            if rate > best * (1.0 + 1e-9):
                best, best_n = rate, n
        return best_n

    def add(self, chances: list[float]) -> None:
        """Count a draft (its chances, one per token) in the step."""
        self.tokens += sum(chances)
        self.rows += len(chances)
