"""POST /v1/chat/completions: messages -> chat template -> one engine request (n samples).

Streaming sends, per choice, a first chunk with the assistant role, then content deltas, and
the finish_reason in the choice's last chunk. Logprobs use the chat format: `content` is a list
of {token, logprob, bytes, top_logprobs}.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from loom.entrypoints.openai.errors import APIError, bad_request, from_exception
from loom.entrypoints.openai.offload import INLINE_TEXT_CHARS, run_sized
from loom.entrypoints.openai.serving_common import (
    ServerContext,
    add_requests,
    build_sampling_params,
    check_prompt_logprobs,
    cancel_on_disconnect,
    check_stream_options,
    collect_final,
    constraint_source,
    include_usage,
    logprob_value,
    merge_streams,
    new_id,
    sse,
    sse_guard,
    usage,
    vllm_prompt_logprobs,
)
from loom.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from loom.structured.params import StructuredOutputsParams
from loom.tokenizer.tokenizer import ChatTemplateError, template_kwargs
from loom.tools.chat import prepare_conversation
from loom.tools.reasoning import ReasoningParser, ReasoningSplit

if TYPE_CHECKING:
    from loom.core.sched_output import Logprobs
    from loom.engine.async_engine import RequestStream
    from loom.engine.outputs import CompletionOutput, RequestOutput
    from loom.sampling_params import SamplingParams
    from loom.entrypoints.openai.protocol import (
        ChatMessage,
        ChatTemplateOptions,
    )
    from loom.tools.parsers import ToolCallView, ToolParser


def render_messages(
    ctx: ServerContext,
    messages: list[ChatMessage],
    options: ChatTemplateOptions,
    tools: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
    truncated: bool = False,
) -> list[int]:
    """Token ids of the conversation in the chat template; template errors are 400s. Its text
    is checked against max_model_len unless `truncated` (truncate_prompt_tokens: the engine
    keeps its end); `add_special_tokens`: the tokenizer's own on top of the template's.

    Slow for a long conversation (templating, tokenizing): call it on a worker thread."""
    if not truncated:
        ctx.check_text_size(sum(_num_chars(m) for m in messages), "messages")
    conversation: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.text()
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}",
                              f"messages[{i}].content")
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": content}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            item["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        conversation.append(item)
    template = ctx.tokenizer.chat_template
    conversation, template_tools = prepare_conversation(
        conversation, tools, template, ctx.tool_parser(template))
    try:
        kwargs = template_kwargs(options.add_generation_prompt, options.continue_final_message,
                                 options.chat_template_kwargs)
        return ctx.tokenizer.encode_chat(conversation, tools=template_tools,
                                         add_special_tokens=add_special_tokens, **kwargs)
    except ChatTemplateError as e:
        raise from_exception(e) from None


def _num_chars(m: ChatMessage) -> int:
    """The characters of a message that reach the prompt (its text and past tool calls)."""
    calls = sum(len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
    return len(m.text() or "") + calls


def _tool_setup(
    ctx: ServerContext, req: ChatCompletionRequest, constrained: bool
) -> tuple[list[dict[str, Any]] | None, ToolParser | None, StructuredOutputsParams | None]:
    """(tools for the prompt, parser for the output, constraint) from tools and tool_choice;
    `constrained`: the request already has an output constraint of its own.

    "none" (or no tools): no tools in the prompt, no parsing. "auto": the model decides; calls
    are parsed from its output. "required" / a named function: generation is constrained to
    valid calls (of that function) in the model's own format.
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, None, None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    if choice == "none":
        return None, None, None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    parser = ctx.tool_parser(ctx.tokenizer.chat_template)
    parser.tools = tools
    if choice in (None, "auto"):
        return tools, parser, None
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not chosen:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in "
                              "tools", "tool_choice")
        parallel = False
    else:
        chosen, parallel = tools, req.parallel_tool_calls is not False
    if constrained:
        raise bad_request("tool_choice 'required' or a named function cannot be combined with "
                          "response_format or another output constraint", "tool_choice")
    for tool in chosen:
        params = tool["function"].get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise bad_request(f"the parameters of {tool['function']['name']!r} must be a JSON "
                              "schema of type object", "tools")
    grammar = parser.grammar(chosen, parallel, ctx.special_id)
    return tools, parser, StructuredOutputsParams(grammar=grammar)


async def create_chat_completion(
    ctx: ServerContext, req: ChatCompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    """Validate, render the conversation, add the request, answer streamed or whole."""
    try:
        return await _create(ctx, req, raw_request)
    except APIError as e:  # name the fields as this endpoint calls them
        if e.param == "logprobs":
            e.param = "top_logprobs"
        elif e.param == "max_tokens" and req.max_completion_tokens is not None:
            e.param = "max_completion_tokens"
        raise


def chat_request(body: dict[str, Any], param: str) -> ChatCompletionRequest:
    """The chat completion another API's request stands for (/v1/responses, /v1/messages:
    fields left None are unset); a 400 naming `param` where it is not one."""
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}, strict=False)
    except ValueError as e:
        raise bad_request(f"invalid {param}: {e}", param) from None


@dataclasses.dataclass
class PreparedChat:
    """A validated chat request ready for the engine: its prompt, sampling parameters (output
    constraint included, `source` the field that set it) and the builder of its answers."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    source: str
    builder: _Builder
    priority: int = 0

    async def add(self, ctx: ServerContext) -> list[RequestStream]:
        return await add_requests(ctx, self.request_id, [self.prompt_ids], self.params,
                                  self.source, priority=self.priority)


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest,
                       request_id: str) -> PreparedChat:
    """Check the request, render its conversation and build its sampling parameters (also
    /v1/responses' path: serving_responses.py)."""
    ctx.check_model(req.model)
    check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    check_prompt_logprobs(req)
    params = build_sampling_params(req, max_tokens, logprobs, req.prompt_logprobs)
    tools, parser, constraint = _tool_setup(ctx, req, params.structured_outputs is not None)
    source = constraint_source(req)
    if constraint is not None:
        params, source = params.clone(structured_outputs=constraint), "tools"
    if parser is not None and any(ctx.special_id(m) is not None for m in parser.MARKERS):
        # the format's markers are special tokens: kept in the text, for the parser to see
        params = params.clone(skip_special_tokens=False)
    ctx.check_capacity(params.n)  # before the (slow) templating
    # Short text without tools is templated on the loop (cheaper than a thread: offload.py).
    size = sum(_num_chars(m) for m in req.messages) if not tools else INLINE_TEXT_CHARS + 1
    prompt_ids = await run_sized(size, INLINE_TEXT_CHARS, render_messages, ctx, req.messages,
                                 req, tools, req.add_special_tokens,
                                 req.truncate_prompt_tokens is not None)
    if req.prediction is not None:  # tokenized as the reply would hold it
        text = req.prediction.text()
        ids = await run_sized(len(text), INLINE_TEXT_CHARS, ctx.tokenizer.encode, text,
                              add_special_tokens=False)
        params = params.clone(prediction=ids)
    reasoning = ctx.reasoning(ctx.tokenizer.chat_template, prompt_ids)
    so = params.structured_outputs
    if reasoning is not None and so is not None:
        so = StructuredOutputsParams.coerce(so)
        if so.enable_in_reasoning:  # the grammar, not the model, chose the first tokens
            reasoning.started = False
        elif reasoning.constraint_mode is not None:
            # a thinking model thinks first: its constraint (structured output, forced tool
            # calls) holds from the answer on, as vLLM's reasoning-aware structured outputs
            params = params.clone(structured_outputs=dataclasses.replace(
                so, thinking=reasoning.constraint_mode))
    builder = _Builder(ctx, req, request_id, int(time.time()), params.n, parser, reasoning)
    return PreparedChat(request_id, prompt_ids, params, source, builder, req.priority)


async def _create(
    ctx: ServerContext, req: ChatCompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    chat = await prepare_chat(ctx, req, new_id("chatcmpl"))
    if req.stream:
        streams = await chat.add(ctx)
        return StreamingResponse(sse_guard(chat.builder.stream(streams)),
                                 media_type="text/event-stream")

    async def work() -> JSONResponse:
        (final,) = await collect_final(await chat.add(ctx))
        return JSONResponse(chat.builder.response(final))

    return await cancel_on_disconnect(raw_request, work)


class _Builder:
    """Turns engine outputs of one chat request into OpenAI chat JSON."""

    def __init__(
        self, ctx: ServerContext, req: ChatCompletionRequest, request_id: str, created: int,
        n: int, parser: ToolParser | None = None, reasoning: ReasoningParser | None = None,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.id = request_id
        self.created = created
        self.n = n
        self.parser = parser
        self.reasoning = reasoning  # None: a thinking block stays in the content
        self.last_output: RequestOutput | None = None  # the newest `chunks` read

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.ctx.token_name(token_id, self.req.return_tokens_as_token_ids)
        return {"token": text, "logprob": logprob_value(logprob),
                "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, token_ids: list[int], lps: list[Logprobs]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        content = []
        for token_id, lp in zip(token_ids, lps):
            entry = self._token(token_id, lp.logprobs[0])
            entry["top_logprobs"] = [self._token(t, v)
                                     for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])]
            content.append(entry)
        return {"content": content}

    def response(self, final: RequestOutput) -> dict[str, Any]:
        """The whole (non-streamed) chat completion."""
        choices = []
        for o in final.outputs:
            text = o.text
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning is not None:
                split = self.reasoning.split(text, final=True)
                text = message["content"] = split.content
                message["reasoning_content"] = split.reasoning or None
            finish_reason = o.finish_reason
            view = (_final_view(self.parser, text, finish_reason) if self.parser is not None
                    else None)
            if view is not None and view.calls:
                message["content"] = view.content or None
                message["tool_calls"] = [
                    {"id": self.parser.call_id(), "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in view.calls
                ]
                finish_reason = _tool_finish_reason(finish_reason)
            choices.append({"index": o.index, "message": message,
                            "logprobs": self._logprobs(o.token_ids, o.logprobs or []),
                            "finish_reason": finish_reason, "stop_reason": o.stop_reason})
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        answer = {"id": self.id, "object": "chat.completion", "created": self.created,
                  "model": self.ctx.model_name, "choices": choices,
                  "usage": usage(len(final.prompt_token_ids), completion_tokens, final.outputs)}
        if self.req.prompt_logprobs is not None:
            answer["prompt_logprobs"] = vllm_prompt_logprobs(self.ctx, final,
                                                             self.req.prompt_logprobs)
        return answer

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.ctx.model_name,
                                 "choices": choices}
        if include_usage(self.req):
            chunk["usage"] = None
        return chunk

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """SSE events: role chunks, content deltas, finish chunks, then usage if asked."""
        async for chunk in self.chunks(streams):
            yield sse(chunk)

    async def chunks(self, streams: list[RequestStream]) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (`stream`'s events before encoding)."""
        for i in range(self.n):
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}])
        done: dict[int, CompletionOutput] = {}  # choice index -> its output, once finished
        tool_streams = {i: _ToolStream(self.parser) for i in range(self.n)} if self.parser else {}
        sent = {i: ReasoningSplit("", "") for i in range(self.n)}  # streamed so far
        prompt_tokens = 0
        async for _, out in merge_streams(streams):
            self.last_output = out
            prompt_tokens = len(out.prompt_token_ids)
            for o in out.outputs:
                if o.index in done:
                    continue
                logprobs = self._logprobs(o.delta_token_ids, o.delta_logprobs)
                has_logprobs = logprobs is not None and bool(logprobs["content"])
                finish_reason = o.finish_reason
                text, thought, grown = o.text, "", o.delta_text
                if self.reasoning is not None:  # the parts' growth since the last chunk
                    split = self.reasoning.split(text, o.finished)
                    before, sent[o.index] = sent[o.index], split
                    text, thought = split.content, split.reasoning[len(before.reasoning):]
                    grown = text[len(before.content):]
                if self.parser is not None:
                    delta = tool_streams[o.index].delta(text, o.finished, finish_reason)
                    if o.finished and tool_streams[o.index].num_calls:
                        finish_reason = _tool_finish_reason(finish_reason)
                else:
                    delta = {"content": grown} if grown else {}
                if thought:
                    delta = {"reasoning_content": thought, **delta}
                if not (delta or o.finished or has_logprobs):
                    continue
                choice = {"index": o.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason, "stop_reason": o.stop_reason}
                yield self._chunk([choice])
                if o.finished:
                    done[o.index] = o
        if include_usage(self.req):
            usage_chunk = self._chunk([])
            usage_chunk["usage"] = usage(prompt_tokens,
                                         sum(len(o.token_ids) for o in done.values()),
                                         done.values())
            yield usage_chunk


def _final_view(parser: ToolParser, text: str, finish_reason: str | None) -> ToolCallView:
    """A finished reply's view. One cut short by max_tokens inside a call keeps the calls read
    so far (the last with the arguments written so far: what streaming sent, and what OpenAI
    returns with "length") instead of the final view's whole text as content."""
    view = parser.view(text, final=True)
    if finish_reason == "length" and not view.calls:
        try:
            cut = parser.view(text, final=False)
        except ValueError:
            return view
        if cut.calls:
            return cut
    return view


def _tool_finish_reason(finish_reason: str | None) -> str | None:
    """A reply that ends in tool calls finishes with "tool_calls" (unless it was cut short)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class _ToolStream:
    """One choice's streamed content and tool-call deltas: the difference between the parser's
    views of the text so far, so the deltas add up to the final (non-streamed) view."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content = ""
        self.calls: list[tuple[str, str]] = []  # (name, arguments) sent so far

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def delta(self, text: str, final: bool, finish_reason: str | None = None) -> dict[str, Any]:
        try:
            view = (_final_view(self.parser, text, finish_reason) if final
                    else self.parser.view(text, final))
        except ValueError:  # not parseable yet: send nothing until it is
            return {}
        delta: dict[str, Any] = {}
        if view.content.startswith(self.content) and len(view.content) > len(self.content):
            delta["content"] = view.content[len(self.content):]
            self.content = view.content
        tool_deltas = []
        for i, call in enumerate(view.calls):
            if i >= len(self.calls):
                tool_deltas.append({"index": i, "id": self.parser.call_id(), "type": "function",
                                    "function": {"name": call.name,
                                                 "arguments": call.arguments}})
                self.calls.append((call.name, call.arguments))
                continue
            sent = self.calls[i][1]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                tool_deltas.append({"index": i,
                                    "function": {"arguments": call.arguments[len(sent):]}})
                self.calls[i] = (call.name, call.arguments)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta
