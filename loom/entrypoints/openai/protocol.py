"""Request bodies of the OpenAI-compatible API, validated strictly.

Strict pydantic models: wrong JSON types are 400s (no "5" -> 5 coercion) and unknown fields are
rejected (`extra="forbid"`), so no parameter is ever accepted and ignored. Accepted beyond
OpenAI's own fields: vLLM's sampling extras (top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, min_tokens, skip_special_tokens, include_stop_str_in_output). `user` is accepted: it
never changes output. `suffix` and `best_of` exist only to be rejected with a clear message.
Ranges are checked by `SamplingParams`, the engine's single source of truth.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None  # default 1.0, as OpenAI
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON string key) -> bias
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: prompt as text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None  # top-N per token, 0..20 (legacy format)
    suffix: str | None = None  # rejected when set
    best_of: int | None = None  # rejected unless 1


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # 0..20, needs logprobs=true


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a text prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
