"""Request bodies of the OpenAI-compatible API, validated strictly.

Strict pydantic models: wrong JSON types are 400s (no "5" -> 5 coercion) and unknown fields are
rejected (`extra="forbid"`), so no parameter is ever accepted and ignored. Accepted beyond
OpenAI's own fields: vLLM's sampling extras (top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, min_tokens, skip_special_tokens, include_stop_str_in_output, allowed_token_ids,
bad_words, truncate_prompt_tokens, prompt_logprobs, return_tokens_as_token_ids, priority),
structured-output
extras (`structured_outputs`, and the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`) and beam search's on completions (`use_beam_search`, `beam_width`,
`length_penalty`, `early_stopping`; serving_beam.py). Chat's `prediction` (OpenAI's predicted
outputs) becomes speculative drafts: it changes speed, never output. `user` is accepted: it
never changes output. `suffix` exists only to be rejected with a clear message, and `best_of`
unless 1 or the beam width.
Ranges are checked by `SamplingParams`, the engine's single source of truth. Sizes are bounded
here (the MAX_* limits below, each a 400 naming the field); the body's size, Unicode and nesting
depth are checked before these models see it (body.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from loom.structured.schema import MAX_JSON_DEPTH, json_text_depth

# Size limits of the request fields that the engine scans per step or compiles.
MAX_STOP = 64  # stop strings (OpenAI allows 4)
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 262144  # allowed_token_ids (Gemma 3's whole vocabulary)
MAX_GRAMMAR_CHARS = 128 * 1024  # a regex, a grammar or a JSON schema given as text
MAX_TOOLS = 128  # as OpenAI
# guided_choice options: past 2,000 the grammar engine refuses a choice itself (with its
# reason); this bounds the grammar text it would first be asked to compile
MAX_CHOICES = 32 * 1024

_StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
_GrammarText = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]


def _prompt_kind(value: Any) -> str:
    """Which prompt form a value is, from its first item alone: a long list of token ids is
    validated as one form, never tried (and failed item by item) as another."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "list[str]"
        if isinstance(first, list):
            return "list[list[int]]"
    return "list[int]"


def _fail_fast(item: Any) -> Any:
    """A list that stops at its first bad item (one error, not one per item)."""
    return Annotated[list[item], Field(fail_fast=True)]  # type: ignore[valid-type]


# The tags are the forms' type names, which error messages leave out of the field's name.
Prompt = Annotated[
    Annotated[str, Tag("str")] | Annotated[_fail_fast(str), Tag("list[str]")]
    | Annotated[_fail_fast(int), Tag("list[int]")]
    | Annotated[_fail_fast(_fail_fast(int)), Tag("list[list[int]]")],
    Discriminator(_prompt_kind),
]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextContent(OpenAIBaseModel):
    """A model whose `content` is text or a list of parts with text (messages, predictions,
    tool results): `text()` joins them."""

    content: Any

    def text(self) -> Any:  # (str, or None where content may be None)
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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

    json_: dict[str, Any] | _GrammarText | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: _GrammarText | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    grammar: _GrammarText | None = None
    any_whitespace: bool = False
    additional_properties: bool = False
    enable_in_reasoning: bool = False  # vLLM's server option, per request: constrain thinking too


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None  # default 1.0, as OpenAI
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # token id (as a JSON string key) -> bias
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    stop: _StopText | list[_StopText] | None = Field(default=None, max_length=MAX_STOP)
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    allowed_token_ids: list[int] | None = Field(default=None, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[_StopText] | None = Field(default=None, max_length=MAX_STOP)
    truncate_prompt_tokens: int | None = None  # the prompt's last N tokens (-1: all that fit)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top N
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprobs' tokens as "token_id:N"
    priority: int = 0  # vLLM's: --scheduling-policy priority's rank (lower first)
    # structured output (OpenAI's response_format, vLLM's extras)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | _GrammarText | None = None
    guided_regex: _GrammarText | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: _GrammarText | None = None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: prompt as text, texts, token ids or lists of token ids."""

    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None  # top-N per token, 0..20 (legacy format)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (a BOS) around a text prompt
    suffix: str | None = None  # rejected when set
    best_of: int | None = None  # rejected unless 1 (or the beam width, with use_beam_search)
    # beam search (vLLM's extras; early_stopping as transformers': true, false or "never")
    use_beam_search: bool | None = False
    beam_width: int | None = None
    length_penalty: float | None = 1.0
    early_stopping: bool | Literal["never"] | None = False


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(OpenAIBaseModel):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _bounded_depth(cls, value: str) -> str:
        if json_text_depth(value) > MAX_JSON_DEPTH:
            raise ValueError(f"the arguments nest deeper than {MAX_JSON_DEPTH} levels")
        return value


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(TextContent):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers



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


class ChatTemplateOptions(OpenAIBaseModel):
    """How messages are rendered with the chat template (vLLM's extras): `add_generation_prompt`
    opens the assistant's turn; `continue_final_message` leaves the last message open for the
    model to continue (an assistant prefill; not with add_generation_prompt);
    `chat_template_kwargs` are further variables of the template (e.g. Qwen3's
    `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class PredictionContent(TextContent):
    """OpenAI's predicted outputs: text the reply is expected to repeat (loom.core.spec_decode
    drafts from it; the reply is what it would be without it)."""

    type: Literal["content"]
    content: str | list[TextContentPart]



class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # 0..20, needs logprobs=true
    tools: list[ChatTool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    prediction: PredictionContent | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's own on top of the template's


# ---- /v1/responses (OpenAI's Responses API; serving_responses.py) ----------------------------

class ResponsesText(OpenAIBaseModel):
    """A content part of an input message: the user's text, or an earlier reply's."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier reply's (Loom writes none)


class ResponsesMessage(TextContent):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponsesText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None



class ResponsesFunctionCall(OpenAIBaseModel):
    """An earlier reply's call, sent back with its result."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("arguments")
    @classmethod
    def _bounded_depth(cls, value: str) -> str:
        return ToolCallFunction._bounded_depth(value)


class ResponsesFunctionCallOutput(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesReasoning(OpenAIBaseModel):
    """An earlier reply's reasoning, sent back by clients that keep the whole output: accepted
    and left out of the prompt (chat templates drop past turns' thinking too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(value: Any) -> str:
    return (value.get("type", "message") if isinstance(value, dict)
            else getattr(value, "type", "message"))


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessage, Tag("message")]
    | Annotated[ResponsesFunctionCall, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponsesReasoning, Tag("reasoning")],
    Discriminator(_item_kind),
]


class ResponsesFunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class ResponsesFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesTextOptions(OpenAIBaseModel):
    format: ResponsesFormat | None = None


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses: OpenAI's Responses API, without its built-in tools, background
    runs, reasoning options or logprobs (each a 400)."""

    model: str | None = None
    input: str | _fail_fast(ResponsesInputItem)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesFunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: ResponsesTextOptions | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    truncation: Literal["disabled"] | None = None


# ---- /v1/messages (Anthropic's Messages API; serving_messages.py) ------------------------------

class CacheControl(OpenAIBaseModel):
    """Anthropic's prompt-caching mark: accepted, and kept as Loom keeps every prefix (its
    prefix cache reuses what any earlier request computed)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class MessagesText(OpenAIBaseModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class MessagesToolUse(OpenAIBaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class MessagesToolResult(TextContent):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[MessagesText] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None



class MessagesThinking(OpenAIBaseModel):
    """An earlier reply's thinking, sent back: left out of the prompt, as templates drop past
    turns' thinking."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "thinking" if kind == "redacted_thinking" else kind


MessagesBlock = Annotated[
    Annotated[MessagesText, Tag("text")] | Annotated[MessagesToolUse, Tag("tool_use")]
    | Annotated[MessagesToolResult, Tag("tool_result")]
    | Annotated[MessagesThinking, Tag("thinking")],
    Discriminator(_block_kind),
]


class MessagesMessage(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[MessagesBlock]


class MessagesTool(OpenAIBaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class MessagesToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesMetadata(OpenAIBaseModel):
    user_id: str | None = None


class MessagesFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class MessagesOutputConfig(OpenAIBaseModel):
    """Anthropic's structured outputs (`format`); `effort` is not implemented (a 400)."""

    format: MessagesFormat | None = None


class MessagesRequest(OpenAIBaseModel):
    """POST /v1/messages: Anthropic's Messages API, without images, documents, server tools,
    citations, effort or thinking budgets (each a 400)."""

    model: str | None = None
    max_tokens: int
    messages: list[MessagesMessage] = Field(min_length=1)
    system: str | list[MessagesText] | None = None
    stop_sequences: list[_StopText] | None = Field(default=None, max_length=MAX_STOP)
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[MessagesTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: MessagesToolChoice | None = None
    metadata: MessagesMetadata | None = None
    output_config: MessagesOutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesCountRequest(OpenAIBaseModel):
    """POST /v1/messages/count_tokens: the prompt a MessagesRequest would have."""

    model: str | None = None
    messages: list[MessagesMessage] = Field(min_length=1)
    system: str | list[MessagesText] | None = None
    tools: list[MessagesTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: MessagesToolChoice | None = None


class TokenizeRequest(ChatTemplateOptions):
    """POST /tokenize: a text prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
