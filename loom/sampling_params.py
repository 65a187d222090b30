"""Per-request sampling parameters, validated at construction (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.errors import SamplingParamsError
from loom.structured.params import StructuredOutputsParams

__all__ = ["SamplingParams", "SamplingParamsError"]

MAX_LOGPROBS = 20
_MAX_N = 128
# seed's range, as vLLM's (torch.long)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """How to sample one request. temperature == 0 means greedy.

    Field names and meanings follow vLLM's `SamplingParams`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (0 = sampled token only)
    prompt_logprobs: int | None = None
    # With prompt_logprobs: the first prompt position whose logprob is needed. The positions
    # before it may come from the prefix cache (their entries are then None), so prompts that
    # share a prefix compute it once (loom.lang's select). 0: every position runs, as in vLLM.
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict of its fields works).
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # An embedding request (LLM.embed, /v1/embeddings): the prompt's final hidden states pooled
    # ("last" token or "mean"), L2-normalised, in RequestOutput.embedding.
    pooling: str | None = None
    # OpenAI's predicted outputs: text (or token ids) the output is expected to repeat, such as
    # the code an edit rewrites. Its tokens are proposed as speculative drafts where the output
    # follows it (loom.core.spec_decode), with or without --speculative-config: a hint for
    # speed that never changes the output.
    prediction: str | list[int] | None = None
    # vLLM's: only these tokens may be sampled (their logits kept, every other one -inf).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. Each is tokenized as written and with a leading space
    # (bad_words_token_ids, filled in by the engine from its tokenizer); a one-token word is
    # banned everywhere, a longer one's last token where the output ends with the rest.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: as many as leave room for max_tokens).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:  # noqa: C901 - one flat list of checks reads best
        def fail(param: str, msg: str) -> None:
            raise SamplingParamsError(param, f"{param} {msg}")

        if not isinstance(self.n, int) or not 1 <= self.n <= _MAX_N:
            fail("n", f"must be an integer in [1, {_MAX_N}], got {self.n!r}")
        if not 0.0 <= self.temperature <= 2.0:
            fail("temperature", f"must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                fail(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    fail("logit_bias", f"token ids must be >= 0, got {tok}")
                if not -100.0 <= bias <= 100.0:
                    fail("logit_bias", f"values must be in [-100, 100], got {bias} for {tok}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not _INT64_MIN <= self.seed <= _INT64_MAX):
            fail("seed", f"must be a 64-bit integer in [{_INT64_MIN}, {_INT64_MAX}], "
                         f"got {self.seed!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            fail("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.prompt_logprobs_start, int) or self.prompt_logprobs_start < 0:
            fail("prompt_logprobs_start",
                 f"must be a non-negative integer, got {self.prompt_logprobs_start!r}")
        if self.pooling is not None and (self.pooling not in ("last", "mean") or self.n != 1):
            fail("pooling", f"must be 'last' or 'mean' with n == 1, got {self.pooling!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        ids = self.allowed_token_ids
        if ids is not None and (not isinstance(ids, list) or not ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids)):
            fail("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            fail("bad_words", "must be a list of non-blank strings")
        words = self.bad_words_token_ids
        if words is not None and (not isinstance(words, list) or any(
                not isinstance(w, list) or not w or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in w)
                for w in words)):
            fail("bad_words_token_ids", "must be lists of non-negative token ids")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t == 0
                              or t < -1):
            fail("truncate_prompt_tokens", f"must be a positive integer or -1, got {t!r}")
        p = self.prediction
        if p is not None and not isinstance(p, str) and (
                not isinstance(p, list)
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in p)):
            fail("prediction", "must be text or a list of non-negative token ids")
        if p is not None and self.pooling is not None:
            fail("prediction", "does not apply to an embedding (pooling) request")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that changes the logits before the choice or reports them
        (penalties, logit_bias, min_tokens, allowed_token_ids, bad_words, logprobs): the token
        is the logits' argmax, which the runner takes without building the sampler's batch
        metadata."""
        return (self.greedy and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and self.repetition_penalty == 1.0 and not self.logit_bias
                and self.min_tokens == 0 and self.logprobs is None
                and self.allowed_token_ids is None
                and not (self.bad_words or self.bad_words_token_ids))

    def clone(self, **changes: object) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)  # type: ignore[arg-type]
