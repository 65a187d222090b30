"""What the engine returns to callers, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.core.sched_output import Logprobs


@dataclass
class CompletionOutput:
    """One of a request's `n` samples. Cumulative fields plus what this step added."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # With a prediction (SamplingParams.prediction): its tokens the output kept and those it
    # did not, as drafts verified so far (OpenAI's usage.completion_tokens_details)
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    # This step's additions (for streaming):
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp.logprobs[0] for lp in self.logprobs)


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic()
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when the request failed alone (its samples finish with "error"): the reason.
    error: str | None = None
    # An embedding request's pooled, normalised hidden state, once it finished.
    embedding: list[float] | None = None
