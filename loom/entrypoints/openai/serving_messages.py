"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

A request becomes the chat completion it stands for, run by serving_chat's path: `system` a
system message; user turns' text blocks user messages and their `tool_result` blocks tool
messages (before the turn's text, as they answer the turn before); assistant turns' text and
`tool_use` blocks an assistant message with tool calls; earlier `thinking` blocks are left
out, as templates drop past thinking; `cache_control` marks are accepted (Loom's prefix cache
keeps every prefix anyway). `tools` are functions whose `input_schema` is their parameters;
`tool_choice` auto / any (required) / tool (named) / none, `disable_parallel_tool_use`;
`output_config.format` (a JSON schema the reply's text follows), `stop_sequences`,
`metadata.user_id`, and the older API's `temperature`, `top_p`, `top_k`.

The reply: a `thinking` block (a thinking model's, where the reasoning parser splits it; its
`signature` empty: Loom signs nothing), a `text` block, a `tool_use` block per call; `stop_reason`
end_turn, max_tokens, stop_sequence (with `stop_sequence`) or tool_use. Streaming sends
Anthropic's events: message_start, per block content_block_start / content_block_delta
(text_delta, thinking_delta, input_json_delta) / content_block_stop, then message_delta (the
stop reason, output tokens) and message_stop. Errors come in Anthropic's envelope
(`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from loom.entrypoints.openai.body import parse_body
from loom.entrypoints.openai.errors import APIError, bad_request, from_exception
from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    MessagesCountRequest,
    MessagesRequest,
    MessagesText,
    MessagesThinking,
    MessagesToolResult,
    MessagesToolUse,
)
from loom.entrypoints.openai.serving_chat import chat_request, prepare_chat, render_messages
from loom.entrypoints.openai.serving_common import (
    cancel_on_disconnect,
    collect_final,
    new_id,
    token_counts,
    typed_sse,
)

if TYPE_CHECKING:
    from loom.engine.async_engine import RequestStream
    from loom.entrypoints.openai.serving_chat import PreparedChat
    from loom.entrypoints.openai.serving_common import ServerContext

# Anthropic's error types by HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(e: Exception) -> JSONResponse:
    """An error as Anthropic's API answers it."""
    api = e if isinstance(e, APIError) else from_exception(e)
    message = api.message if not api.param or api.message.startswith(api.param) else (
        f"{api.param}: {api.message}")
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(api.status, "api_error"),
                                       "message": message}}
    return JSONResponse(body, status_code=api.status, headers=api.headers)


def _system(system: str | list[MessagesText] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(b.text for b in system)
    return [{"role": "system", "content": text}]


def _conversation(req: MessagesRequest | MessagesCountRequest) -> list[dict[str, Any]]:
    """The turns as chat messages (dicts of ChatMessage's fields)."""
    messages = _system(req.system)
    for turn in req.messages:
        if isinstance(turn.content, str):
            messages.append({"role": turn.role, "content": turn.content})
            continue
        text = "".join(b.text for b in turn.content if isinstance(b, MessagesText))
        if turn.role == "user":
            for b in turn.content:
                if isinstance(b, MessagesToolResult):
                    content = b.text()
                    messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                     "content": f"Error: {content}" if b.is_error else content})
            if text or not any(isinstance(b, MessagesToolResult) for b in turn.content):
                messages.append({"role": "user", "content": text})
            continue
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in turn.content if isinstance(b, MessagesToolUse)]
        if any(isinstance(b, MessagesToolResult) for b in turn.content):
            raise bad_request("tool_result blocks belong in user turns", "messages")
        message: dict[str, Any] = {"role": "assistant", "content": text or (
            None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if calls or text or not all(isinstance(b, MessagesThinking) for b in turn.content):
            messages.append(message)
    return messages


def _tools(req: MessagesRequest | MessagesCountRequest) -> dict[str, Any]:
    """The chat request's tools and tool_choice fields."""
    body: dict[str, Any] = {}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type tool needs a name", "tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


def _chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": req.model, "messages": _conversation(req), "stream": req.stream,
        "max_completion_tokens": req.max_tokens, "stop": req.stop_sequences,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "user": req.metadata.user_id if req.metadata is not None else None, **_tools(req)}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt.schema_}}
    return chat_request(body, "messages")


def _stop_reason(finish_reason: str | None, stop: object) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from a chat choice's finish and stop reasons."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as tool_use's `input` (a call cut short: what parsed, else {})."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's message as content blocks."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _arguments(call["function"]["arguments"])})
    return blocks


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    """Anthropic's usage (from token_counts): input_tokens are the prompt's tokens the prefix
    cache did not hold (cache_read_input_tokens the rest), as its API splits them."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def create_message(ctx: ServerContext,
                         raw_request: Request) -> JSONResponse | StreamingResponse:
    """Parse, run as a chat completion, answer as a message (streamed or whole); every error
    in Anthropic's envelope."""
    try:
        req = await parse_body(raw_request, MessagesRequest)
        if req.max_tokens < 1:
            raise bad_request("max_tokens must be at least 1", "max_tokens")
        chat = await prepare_chat(ctx, _chat_request(req), new_id("msg"))
        if req.stream:
            streams = await chat.add(ctx)
            return StreamingResponse(_events(ctx, chat, streams), media_type="text/event-stream")

        async def work() -> JSONResponse:
            (final,) = await collect_final(await chat.add(ctx))
            choice = chat.builder.response(final)["choices"][0]
            stop_reason, stop_sequence = _stop_reason(choice["finish_reason"],
                                                      choice["stop_reason"])
            return JSONResponse({
                "id": chat.request_id, "type": "message", "role": "assistant",
                "model": ctx.model_name, "content": _blocks(choice["message"]),
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": _usage(*token_counts(final))})

        return await cancel_on_disconnect(raw_request, work)
    except Exception as e:  # noqa: BLE001 - every error in Anthropic's envelope
        return anthropic_error(e)


async def count_tokens(ctx: ServerContext, raw_request: Request) -> JSONResponse:
    """The prompt's tokens as /v1/messages would render it (template, tools)."""
    try:
        req = await parse_body(raw_request, MessagesCountRequest)
        ctx.check_model(req.model)
        chat = chat_request({"messages": _conversation(req), **_tools(req)}, "messages")
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()] \
            if chat.tool_choice != "none" else None
        ids = render_messages(ctx, chat.messages, chat, tools or None)
        return JSONResponse({"input_tokens": len(ids)})
    except Exception as e:  # noqa: BLE001
        return anthropic_error(e)


class _Blocks:
    """The stream's content blocks from chat chunks, one open at a time (thinking, text, then
    each tool_use), closed when the next kind of delta comes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.calls: set[int] = set()

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        return out + [typed_sse("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [typed_sse("content_block_stop", index=self.index)]

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(typed_sse("content_block_delta", index=self.index, delta={
                "type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(typed_sse("content_block_delta", index=self.index,
                              delta={"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            if call["index"] not in self.calls:
                self.calls.add(call["index"])
                out += self._start({"type": "tool_use", "id": call["id"],
                                    "name": call["function"]["name"], "input": {}})
            args = call["function"].get("arguments")
            if args:
                out.append(typed_sse("content_block_delta", index=self.index, delta={
                    "type": "input_json_delta", "partial_json": args}))
        return out


async def _events(ctx: ServerContext, chat: PreparedChat,
                  streams: list[RequestStream]) -> AsyncIterator[str]:
    prompt_tokens = len(chat.prompt_ids)
    yield typed_sse("message_start", message={
        "id": chat.request_id, "type": "message", "role": "assistant", "model": ctx.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": _usage(prompt_tokens, 0, 0)})
    blocks = _Blocks()
    finish, stop = None, None
    try:
        async for chunk in chat.builder.chunks(streams):
            for choice in chunk["choices"]:
                for event in blocks.delta(choice["delta"]):
                    yield event
                if choice["finish_reason"] is not None:
                    finish, stop = choice["finish_reason"], choice["stop_reason"]
        for event in blocks.close():
            yield event
        final = chat.builder.last_output
        assert final is not None and final.finished
        stop_reason, stop_sequence = _stop_reason(finish, stop)
        usage = _usage(*token_counts(final))
        yield typed_sse("message_delta", delta={"stop_reason": stop_reason,
                                             "stop_sequence": stop_sequence}, usage=usage)
        yield typed_sse("message_stop")
    except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in-band
        error = json.loads(anthropic_error(e).body)["error"]
        yield typed_sse("error", error=error)
