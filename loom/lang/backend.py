"""What a program needs from a model: generate text, and score choices by their logprobs.

Two implementations: `EngineBackend` (Loom's engine in this process) and `OpenAIBackend` (any
OpenAI-compatible server; Loom's own does everything exactly). Both are thread-safe: a
program's forks and `run_batch`'s programs call them from several threads at once, and those
calls reach the engine together, so the scheduler batches them and shares their prefixes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from loom.lang.errors import LangError

if TYPE_CHECKING:
    from loom.lang.ir import GenSpec
    from loom.lang.template import ChatTemplate

OnDelta = Callable[[str], None]


@dataclass
class GenResult:
    """One generation: its text and what the backend told about it."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache (if known)


@dataclass
class ChoiceScores:
    """Each choice's logprob given the state (`exact` False: a fallback that did not score)."""

    choices: list[str]
    logprobs: list[float | None]  # summed over the choice's tokens
    token_logprobs: list[list[float]]  # per scored token
    exact: bool = True

    @classmethod
    def from_token_logprobs(cls, choices: Sequence[str],
                            token_logprobs: list[list[float]]) -> ChoiceScores:
        """Exact scores: a choice's logprob is the sum of its scored tokens' logprobs."""
        return cls(list(choices), [sum(t) for t in token_logprobs], token_logprobs)

    def best(self, method: Literal["sum", "mean"] = "sum") -> int:
        """Index of the winning choice (first of equals)."""
        def key(i: int) -> float:
            total = self.logprobs[i]
            if total is None:
                return float("-inf")
            return total / max(1, len(self.token_logprobs[i])) if method == "mean" else total

        return max(range(len(self.choices)), key=key)


def scored_span(prefix_ids: list[int], choice_ids: Sequence[list[int]]) -> int:
    """Where scoring starts in every `choice_ids[i]` (the prefix text plus choice i, tokenized
    together): the longest run of leading tokens that all of them share with the prefix alone.

    Tokenizers merge across the join (a trailing space with the next word), so a choice's own
    tokens are not simply appended to the prefix's; scoring every choice from one common
    position compares the probabilities of whole texts under one shared context.
    """
    start = len(prefix_ids)
    for ids in choice_ids:
        common = 0
        for a, b in zip(prefix_ids, ids):
            if a != b:
                break
            common += 1
        start = min(start, common)
    if start < 1:
        raise LangError("select needs some text before it (the first token has no logprob)")
    for ids in choice_ids:
        if len(ids) <= start:
            raise LangError("a select choice adds no token after the prompt")
    return start


class Backend(ABC):
    """The model a program runs on. `chat_template` renders roles (None: roles are errors)."""

    chat_template: ChatTemplate | None = None

    @abstractmethod
    def generate(self, prompt: str, spec: GenSpec, on_delta: OnDelta | None = None) -> GenResult:
        """Generate after `prompt`; `on_delta` receives the text as it comes (any thread)."""

    @abstractmethod
    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        """Each choice's summed token logprob after `prompt`, all choices in one batch."""

    def close(self) -> None:
        """Release what the backend started (threads, connections)."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
