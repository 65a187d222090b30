"""Request bodies of the OpenAI-compatible API, validated strictly.

Strict pydantic models: wrong JSON types are 400s (no "5" -> 5 coercion) and unknown fields are
rejected (`extra="forbid"`), so no parameter is ever accepted and ignored. Accepted beyond
OpenAI's own fields: vLLM's sampling extras (top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, min_tokens, skip_special_tokens, include_stop_str_in_output) and structured-output
extras (`structured_outputs`, and the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`). `user` is accepted: it never changes output. `suffix` and `best_of` exist only to be rejected with a clear message.
Ranges are checked by `SamplingParams`, the engine's single source of truth.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class JsonSchemaSpec(OpenAIBaseModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = False
    additional_properties: bool = False


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
    # structured output (OpenAI's response_format, vLLM's extras)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


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


class ToolCallFunction(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # 0..20, needs logprobs=true
    tools: list[ChatTool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


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
