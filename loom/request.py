"""One generation request as the engine core sees it: token ids, progress and status (no text)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from loom.block_hash import BlockHash, extend_block_hashes

if TYPE_CHECKING:
    import numpy as np

    from loom.sampling_params import SamplingParams
    from loom.structured.backend import GrammarMatcher


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING ...) -> one FINISHED_* state."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status after PREEMPTED is final (`is_finished` relies on this order).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request alone failed (its input broke a step's part)

    def is_finished(self) -> bool:
        """True for the final states; callable as `status.is_finished()` or
        `RequestStatus.is_finished(status)` (vLLM's spelling)."""
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> FinishReason | None:
        """The OpenAI-style reason for a final state, None while the request is alive."""
        return _FINISH_REASONS.get(self)


class FinishReason(str, enum.Enum):
    """Why a request finished, as reported to clients."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


# How the reason of a request that failed on its own output constraint begins (the engine's
# callers tell such failures, caused by the request's input, from internal ones by it).
CONSTRAINT_FAILED = "the output constraint failed during generation"


class Request:
    """A request's token ids and scheduling state.

    Invariants:
    - `all_token_ids == prompt_token_ids + output_token_ids`; mutate only through
      `append_output_token_ids`.
    - `0 <= num_computed_tokens <= num_tokens`: tokens whose KV is in the cache (or scheduled
      to be written this step).
    - Once block hashing is on (`block_size` set), `block_hashes[i]` is the chained hash of
      full block i, for every full block of `all_token_ids` and no partial one.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "output_token_ids", "num_prompt_tokens", "num_computed_tokens", "status",
        "block_hashes", "num_cached_tokens", "stop_reason", "num_preemptions", "max_tokens",
        "block_size", "extra_keys", "grammar", "_all_token_ids", "prediction",
        "prediction_tokens", "num_prompt_logprobs", "priority",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        *,
        block_size: int | None = None,
        extra_keys: tuple[object, ...] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # The priority scheduling policy's rank (lower first; the default policy ignores it).
        self.priority = priority
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        # Hashes of full blocks only; filled once `block_size` is known.
        self.block_hashes: list[BlockHash] = []
        # Prefix-cache hit tokens at the first schedule; -1 until then.
        self.num_cached_tokens = -1
        # The stop token id (or stop string, set by the front) that finished the request.
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prompt tokens whose prompt logprobs went out (from token 0): a preempted request's
        # recomputation scores some again, and those are not sent twice.
        self.num_prompt_logprobs = 0
        # Resolved output cap: the scheduler fills it in when sampling_params.max_tokens is None.
        self.max_tokens: int | None = sampling_params.max_tokens
        # Extra hash keys for every block (e.g. a LoRA id or cache salt).
        self.extra_keys = extra_keys
        self.block_size: int | None = None
        # Structured output: the grammar state that follows this request's output tokens.
        self.grammar: GrammarMatcher | None = None
        # Predicted outputs (SamplingParams.prediction), tokenized by the engine: the drafts'
        # source, and [accepted, rejected] draft tokens from it so far (OpenAI's usage).
        self.prediction: np.ndarray | None = None
        self.prediction_tokens = [0, 0]
        if block_size is not None:
            self.enable_block_hashing(block_size)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read only: use `append_output_token_ids` to grow it."""
        return self._all_token_ids

    def enable_block_hashing(self, block_size: int) -> None:
        """Start keeping `block_hashes` for blocks of `block_size` tokens (idempotent)."""
        if self.block_size is not None:
            if self.block_size != block_size:
                raise ValueError(
                    f"request {self.request_id!r}: block_size already {self.block_size}, "
                    f"got {block_size}"
                )
            return
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        extend_block_hashes(self.block_hashes, self._all_token_ids, block_size, self.extra_keys)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens and hash any block they complete."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)
        if self.block_size is not None:
            extend_block_hashes(
                self.block_hashes, self._all_token_ids, self.block_size, self.extra_keys
            )

    def is_finished(self) -> bool:
        return self.status.is_finished()

    def get_finished_reason(self) -> FinishReason | None:
        return self.status.finish_reason()

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
