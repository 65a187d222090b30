"""What the engine core reports per request per step (token ids only; the front detokenizes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.core.sched_output import Logprobs
    from loom.request import FinishReason


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request from one step; `finish_reason` is set on its last output."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None  # one per new token (None: not asked for)
    new_prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that finished the request (None for eos, length or abort).
    stop_reason: int | str | None = None
    # Prompt tokens served from the prefix cache at the first schedule.
    num_cached_tokens: int = 0
    # Why this request alone failed (finish_reason ERROR): shown to its client, no one else's.
    error: str | None = None
    # A request with a prediction: its draft tokens accepted and rejected so far.
    prediction_tokens: tuple[int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
