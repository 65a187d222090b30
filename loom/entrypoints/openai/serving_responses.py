"""POST /v1/responses (OpenAI's Responses API) and GET / DELETE /v1/responses/{id}.

A request becomes the chat completion it stands for, run by serving_chat's path (template,
tools and their parser, structured output, thinking): `instructions` a system message first;
`input` text a user message, or items: messages, earlier `function_call`s (an assistant turn
calling them) and their `function_call_output`s (tool messages); earlier `reasoning` items
are accepted and left out of the prompt, as chat templates leave out past turns' thinking. The
reply becomes output items: a `reasoning` item (a thinking model's block, where the reasoning
parser is on), a `message` with one `output_text`, then a `function_call` per tool call.

Responses are kept (unless `store: false`) in memory, the newest RESPONSES_KEPT of them
(serving_common.ResponseStore), for
`previous_response_id` (the earlier conversation, its input and output, comes first; its
instructions do not, as OpenAI's API) and GET. Streaming sends OpenAI's events: created,
in_progress, then per output item `output_item.added`, its deltas (`reasoning_text`,
`output_text` inside a `content_part`, `function_call_arguments`), its `.done` events and
`output_item.done`, and `response.completed` (`response.incomplete` when max_output_tokens cut
it short), each with its `sequence_number`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from loom.entrypoints.openai.errors import APIError, bad_request, from_exception
from loom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ResponsesFunctionCall,
    ResponsesFunctionCallOutput,
    ResponsesMessage,
    ResponsesRequest,
)
from loom.entrypoints.openai.serving_chat import chat_request, prepare_chat
from loom.entrypoints.openai.serving_common import (
    cancel_on_disconnect,
    collect_final,
    new_id,
    token_counts,
    typed_sse,
)

if TYPE_CHECKING:
    from loom.engine.async_engine import RequestStream
    from loom.engine.outputs import RequestOutput
    from loom.entrypoints.openai.serving_chat import PreparedChat
    from loom.entrypoints.openai.serving_common import ServerContext


def _conversation(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (dicts of ChatMessage's fields)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, ResponsesMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, ResponsesFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponsesFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    return messages


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion `req` stands for: its instructions, then `messages` (the stored
    conversation and the request's input)."""
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    if not messages:
        raise bad_request("input holds no message", "input")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "max_completion_tokens": req.max_output_tokens, "user": req.user,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                        exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if (
        choice is not None and not isinstance(choice, str)) else choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or fmt.name is None:
            raise bad_request("text.format of type json_schema needs a name and a schema",
                              "text.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
            "description": fmt.description}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return chat_request(body, "input")


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a response repeats them."""
    choice = req.tool_choice
    return {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text is not None and req.text.format is not None
                            else {"type": "text"})},
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(
            choice, str) else (choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "truncation": "disabled", "user": req.user, "store": req.store is not False,
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _outputs(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's message as output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        items.append(_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"]))
    return items


def _as_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items as the chat message that continues a conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if item["type"] == "message":
            message["content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return message


def _usage(prompt_tokens: int, output_tokens: int, cached: int,
           reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's usage from token_counts and the reasoning's tokens."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


class _Response:
    """One response's object as it grows, and what the store keeps of it."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, chat: PreparedChat,
                 history: list[dict[str, Any]], turns: list[dict[str, Any]]) -> None:
        self.ctx = ctx
        self.req = req
        self.history, self.turns = history, turns  # the stored conversation, this input
        self.body: dict[str, Any] = {
            "id": chat.request_id, "object": "response", "created_at": int(time.time()),
            "model": ctx.model_name, "status": "in_progress", "error": None,
            "incomplete_details": None, "output": [], "usage": None, **_echo(req)}

    def reasoning_tokens(self, items: list[dict[str, Any]]) -> int:
        """Tokens of the reasoning text (re-encoded: the reply's own tokens are not split)."""
        text = "".join(c["text"] for i in items if i["type"] == "reasoning"
                       for c in i["content"])
        return len(self.ctx.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def finish(self, items: list[dict[str, Any]], finish_reason: str | None,
               final: RequestOutput) -> dict[str, Any]:
        """The whole response of `final`'s output `items` (stored unless store is false)."""
        cut = finish_reason == "length"
        self.body.update(
            output=items, status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage=_usage(*token_counts(final), self.reasoning_tokens(items)))
        if self.req.store is not False:
            added = [*self.turns, _as_message(items)]
            self.ctx.responses.put(self.body, self.history + added, len(json.dumps(added)))
        return self.body


async def create_response(ctx: ServerContext, req: ResponsesRequest,
                          raw_request: Request) -> JSONResponse | StreamingResponse:
    """Validate, run as a chat completion, answer as a response (streamed or whole)."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        history = ctx.responses.get(req.previous_response_id, "previous_response_id")[1]
    turns = _conversation(req)
    try:
        chat = await prepare_chat(ctx, _chat_request(req, history + turns), new_id("resp"))
    except APIError as e:  # name the fields as this endpoint calls them
        e.param = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                   "response_format": "text.format"}.get(e.param or "", e.param)
        raise
    response = _Response(ctx, req, chat, history, turns)
    if req.stream:
        streams = await chat.add(ctx)
        return StreamingResponse(_events(response, chat, streams),
                                 media_type="text/event-stream")

    async def work() -> JSONResponse:
        (final,) = await collect_final(await chat.add(ctx))
        choice = chat.builder.response(final)["choices"][0]
        return JSONResponse(response.finish(_outputs(choice["message"]),
                                            choice["finish_reason"], final))

    return await cancel_on_disconnect(raw_request, work)


class _Events:
    """The stream's events from chat chunks: one output item open at a time (reasoning, then
    the message, then each function call), closed when the next kind of delta comes."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open item's text (reasoning, message) or arguments so far
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index

    def emit(self, kind: str, **fields: Any) -> str:
        event = typed_sse(kind, sequence_number=self.seq, **fields)
        self.seq += 1
        return event

    def _index(self) -> int:
        return len(self.items) - 1

    def close(self) -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        at, item_id = self._index(), item["id"]
        if item["type"] == "reasoning":
            item.update(content=[{"type": "reasoning_text", "text": self.text}],
                        status="completed")
            out.append(self.emit("response.reasoning_text.done", item_id=item_id,
                                 output_index=at, content_index=0, text=self.text))
        elif item["type"] == "message":
            part = _text_part(self.text)
            item.update(content=[part], status="completed")
            out.append(self.emit("response.output_text.done", item_id=item_id, output_index=at,
                                 content_index=0, text=self.text, logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item_id,
                                 output_index=at, content_index=0, part=part))
        else:
            item.update(arguments=self.text, status="completed")
            out.append(self.emit("response.function_call_arguments.done", item_id=item_id,
                                 output_index=at, arguments=self.text, name=item["name"]))
        out.append(self.emit("response.output_item.done", output_index=at, item=item))
        self.open, self.text = None, ""
        return out

    def start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.items.append(item)
        self.open = item
        out.append(self.emit("response.output_item.added", output_index=self._index(),
                             item={**item, "content": []} if item["type"] != "function_call"
                             else item))
        if item["type"] == "message":
            out.append(self.emit("response.content_part.added", item_id=item["id"],
                                 output_index=self._index(), content_index=0,
                                 part=_text_part("")))
        return out

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self.start(_reasoning_item(new_id("rs"), ""))
            out += self._grow("response.reasoning_text.delta", delta["reasoning_content"],
                              content_index=0)
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self.start(_message_item(new_id("msg"), "", "in_progress"))
            out += self._grow("response.output_text.delta", delta["content"], content_index=0,
                              logprobs=[])
        for call in delta.get("tool_calls") or ():
            if call["index"] not in self.calls:
                fn = call["function"]
                out += self.start(_call_item(new_id("fc"), call["id"], fn["name"], "",
                                             "in_progress"))
                self.calls[call["index"]] = self._index()
            args = call["function"].get("arguments") or ""
            if args:
                out += self._grow("response.function_call_arguments.delta", args)
        return out

    def _grow(self, kind: str, text: str, **fields: Any) -> list[str]:
        self.text += text
        assert self.open is not None
        return [self.emit(kind, item_id=self.open["id"], output_index=self._index(),
                          delta=text, **fields)]


async def _events(response: _Response, chat: PreparedChat,
                  streams: list[RequestStream]) -> AsyncIterator[str]:
    events = _Events()
    yield events.emit("response.created", response=response.body)
    yield events.emit("response.in_progress", response=response.body)
    finish: str | None = None
    try:
        async for chunk in chat.builder.chunks(streams):
            for choice in chunk["choices"]:
                for event in events.delta(choice["delta"]):
                    yield event
                finish = choice["finish_reason"] or finish
        for event in events.close():
            yield event
        final = chat.builder.last_output
        assert final is not None and final.finished
        body = response.finish(events.items, finish, final)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield events.emit(kind, response=body)
    except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in-band
        error = from_exception(e).body()["error"]
        yield events.emit("error", code=error.get("code"), message=error["message"],
                          param=error.get("param"))
