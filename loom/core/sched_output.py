"""Plain data passed between the scheduler and the model runner (integers and lists only; the
engine adds the structured-output bitmask, and a sampled draft model its distributions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from loom.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption.

    `token_ids` holds the prompt followed by any tokens generated before a preemption.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # A hybrid model's prefix hit: the key of the state snapshot its slot starts from
    state_key: object = None
    # The generator its random draws take (a draft model's sampled drafts: the proposer keeps
    # one a request across steps); None: from its seed, if any, as always
    generator: torch.Generator | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds; parallel lists, one entry per request."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (a prefill chunk, or 1 for a decode)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose runner state must be dropped before this step: finished, aborted, preempted.
    finished_req_ids: set[str]
    # Those of them preempted: the runner keeps a seeded request's generator for its resumption,
    # so its draws go on where they stopped (its tokens as without the preemption).
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output, filled by the engine after scheduling: the allowed-token bitmask
    # [rows, ceil(vocab / 32)] int32 of the constrained requests that sample this step, and
    # req_id -> its row. None when no constrained request samples.
    grammar_bitmask: torch.Tensor | None = None
    structured_rows: dict[str, int] | None = None
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token (their
    # count is in num_scheduled_tokens); the runner verifies them (loom.worker.spec_verify).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # ... and where a draft model sampled them (a sampled request's draft), the distribution
    # each was drawn from [len(draft), vocab]; absent: point masses (greedy, n-gram drafts)
    spec_decode_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    # Decode steps past this one that the runner runs before returning (num_scheduler_steps):
    # every scheduled request decodes one token with the argmax alone; its KV slots are
    # allocated for 1 + lookahead tokens, and it gets 1 + lookahead sampled tokens.
    lookahead: int = 0
    # A hybrid model with prefix caching: req_id -> the hash of the block this step's tokens
    # end on, for the requests whose step ends on a block boundary (the runner keeps a copy
    # of their states under it: loom.layers.recurrent.StateSnapshots)
    state_keys: dict[str, object] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class Logprobs:
    """Logprobs for one position: the chosen token first, then the top-N (may repeat it)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # rank of each token id in the full distribution (1 = most likely)


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request, in req_ids order: the token sampled this step, or [] when the step
    # only computed part of the prompt (chunked prefill).
    sampled_token_ids: list[list[int]]
    # Per request: logprobs of each sampled token, one per entry of sampled_token_ids[i] (None
    # unless the request asked for logprobs).
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)
    # Per request: logprobs for the prompt positions computed this step (None unless asked).
    prompt_logprobs: list[list[Logprobs | None] | None] = field(default_factory=list)
    # Requests that failed alone this step (their inputs broke preparing, sampling or the
    # grammar), req_id -> reason; the scheduler finishes them with FINISHED_ERROR.
    failed: dict[str, str] = field(default_factory=dict)
