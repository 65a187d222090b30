"""What completions and chat share: the server context, SamplingParams from a request, adding
several engine requests at once, merging their streams, SSE framing, logprob values and
aborting on client disconnect."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from loom.engine.async_engine import QueueFullError
from loom.entrypoints.openai.errors import APIError, bad_request, from_exception
from loom.entrypoints.openai.offload import INLINE_TEXT_CHARS, run_sized
from loom.engine.llm_engine import InvalidRequestError
from loom.sampling_params import SamplingParams, SamplingParamsError
from loom.structured.params import StructuredOutputsParams
from loom.tools.parsers import ToolParser, parser_for_template
from loom.tools.reasoning import (
    ReasoningParser,
    closes_thinking,
    opens_thinking,
    parser_enabled,
)

if TYPE_CHECKING:
    from loom.engine.async_engine import AsyncEngine, RequestStream
    from loom.core.sched_output import Logprobs
    from loom.engine.outputs import CompletionOutput, RequestOutput
    from loom.entrypoints.openai.protocol import SamplingRequest
    from loom.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

# JSON has no -inf; a token the model rules out gets this finite stand-in.
MIN_LOGPROB = -9999.0


RESPONSES_KEPT = 256  # /v1/responses kept for previous_response_id and GET
RESPONSES_KEPT_CHARS = 64 * 2**20  # and at most about this much text in them


class ResponseStore:
    """The newest /v1/responses answers, each with the conversation it ends (serving_responses:
    previous_response_id continues it); thread-safe, bounded in number and in the text each
    added (so clients storing long conversations cannot grow the server without bound)."""

    def __init__(self, size: int = RESPONSES_KEPT, max_chars: int = RESPONSES_KEPT_CHARS) -> None:
        self.size = size
        self.max_chars = max_chars
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = \
            OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            chars: int) -> None:
        """Keep `response`; `chars`: the text it added to the conversation it continues."""
        with self._lock:
            self._items[response["id"]] = (response, conversation, chars)
            self._chars += chars
            while len(self._items) > 1 and (len(self._items) > self.size
                                            or self._chars > self.max_chars):
                self._chars -= self._items.popitem(last=False)[1][2]

    def get(self, response_id: str, param: str | None = None
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(response, conversation); a 404 naming `param` if it is not kept."""
        with self._lock:
            item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"no response with id {response_id!r} is kept (the newest "
                                f"stored ones are: at most {self.size})", param, "not_found")
        return item[0], item[1]

    def delete(self, response_id: str) -> None:
        with self._lock:
            found = self._items.pop(response_id, None)
            if found is not None:
                self._chars -= found[2]
        if found is None:
            raise APIError(404, f"no response with id {response_id!r} is kept", None,
                           "not_found")


@dataclass
class ServerContext:
    """What every handler needs; lives on `app.state.loom`."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    log_requests: bool = True
    shutting_down: bool = False
    decoded_tokens: dict[int, str] = field(default_factory=dict)
    special_ids: dict[str, int | None] = field(default_factory=dict)
    responses: ResponseStore = field(default_factory=ResponseStore)
    tool_call_parser: str = "auto"  # a name in loom.tools.parsers.PARSERS, or "auto"
    reasoning_parser: str = "auto"  # loom.tools.reasoning.MODES
    # The most characters of text one token stands for (the longest token); text longer than
    # max_model_len such tokens cannot fit and is refused without tokenizing it. 0: no bound.
    max_token_chars: int = 0

    @property
    def max_prompt_chars(self) -> int | None:
        return self.max_token_chars * self.max_model_len if self.max_token_chars else None

    def check_text_size(self, num_chars: int, param: str) -> None:
        """400 for text too long to fit max_model_len whatever its tokens (cheap: no
        tokenizing)."""
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise bad_request(
                f"{param} has {num_chars} characters: more than max_model_len "
                f"({self.max_model_len}) tokens of at most {self.max_token_chars} characters "
                "each can hold", param)

    def check_ids_size(self, num_ids: int, param: str) -> None:
        if num_ids >= self.max_model_len:
            raise bad_request(
                f"{param} has {num_ids} tokens; max_model_len is {self.max_model_len}, which "
                "must leave room for at least one generated token", param)

    def check_capacity(self, n: int) -> None:
        """429 at once when the waiting queue is full (before any tokenizing)."""
        try:
            self.engine.check_capacity(n)
        except QueueFullError as e:
            raise from_exception(e) from None

    def tool_parser(self, template: str | None) -> ToolParser:
        return parser_for_template(template, self.tool_call_parser)

    def special_id(self, text: str) -> int | None:
        """The id of the special token whose text is `text` (a tool-call marker), None if
        the tokenizer holds it as no such token (cached)."""
        if text not in self.special_ids:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.special_ids[text] = ids[0] if len(ids) == 1 and self.tokenizer.decode(
                ids, skip_special_tokens=True) == "" else None
        return self.special_ids[text]

    def reasoning(self, template: str | None, prompt_ids: list[int]) -> ReasoningParser | None:
        """The reasoning parser of a chat reply to `prompt_ids` (None: thinking stays in
        content), told whether the prompt opened a thinking block itself or closed one."""
        if not parser_enabled(self.reasoning_parser, template):
            return None
        tail = self.tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
        return ReasoningParser(opens_thinking(tail), closes_thinking(tail))

    def check_model(self, model: str | None) -> None:
        """None means the served model; any other name is a 404."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")

    def check_accepting(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")

    def token_name(self, token_id: int, as_id: bool | None) -> str:
        """A token as logprobs name it: its text, or vLLM's "token_id:N" (`as_id`:
        return_tokens_as_token_ids) where a text cannot say which token it was."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI shows it in logprobs (cached; vocab is finite)."""
        text = self.decoded_tokens.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.decoded_tokens[token_id] = text
        return text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def logprob_value(x: float) -> float:
    return MIN_LOGPROB if math.isinf(x) or math.isnan(x) else max(x, MIN_LOGPROB)


def prompt_logprobs_of(out: RequestOutput) -> list[Logprobs | None]:
    """One entry per prompt token: its logprobs, or None (the first token, and any the engine
    did not score)."""
    lps = list(out.prompt_logprobs or [])
    return lps + [None] * (len(out.prompt_token_ids) - len(lps))


def vllm_prompt_logprobs(ctx: ServerContext, out: RequestOutput, n: int) -> list[Any]:
    """vLLM's `prompt_logprobs` of a request: per prompt token None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}} for the token itself and the top `n`."""
    return [None if lp is None else
            {str(t): {"logprob": logprob_value(v), "rank": r, "decoded_token": ctx.token_text(t)}
             for t, v, r in zip(lp.token_ids[: 1 + n], lp.logprobs[: 1 + n], lp.ranks[: 1 + n])}
            for lp in prompt_logprobs_of(out)]


def check_prompt_logprobs(req: SamplingRequest) -> None:
    """vLLM's prompt_logprobs come with the whole answer, not in a stream."""
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not supported with stream", "prompt_logprobs")


def build_sampling_params(
    req: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams from the shared fields; a bad value is a 400 naming the field."""
    logit_bias = None
    if req.logit_bias is not None:
        try:
            logit_bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)",
                              "logit_bias") from None
    structured = structured_outputs_from(req)
    try:
        return SamplingParams(
            n=req.n if req.n is not None else 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias,
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens is not False,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            structured_outputs=structured,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from None


def _constraint_fields(req: SamplingRequest) -> list[tuple[str, dict[str, Any]]]:
    """(request field, StructuredOutputsParams fields) for every field that sets a constraint."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              "response_format")
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        so = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        so = {k: v for k, v in so.items() if v is not False}
        found.append(("structured_outputs", so))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    return found


def constraint_source(req: SamplingRequest) -> str:
    """The request field that set its output constraint (for error messages)."""
    found = _constraint_fields(req)
    return found[0][0] if found else "structured_outputs"


def structured_outputs_from(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever one field sets it (400 if several)."""
    found = _constraint_fields(req)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"set at most one output constraint; got {names}", found[1][0])
    name, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except SamplingParamsError as e:
        raise bad_request(str(e).replace("structured_outputs", name, 1), name) from None


def as_prompts(value: str | list[Any], param: str) -> list[str | list[int]]:
    """A prompt-like field (text, texts, token ids or lists of token ids: protocol.Prompt) as
    a list of prompts; 400 naming `param` when it is an empty list."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    if isinstance(value[0], int):
        return [list(value)]
    return list(value)


def check_prompt_sizes(
    ctx: ServerContext, prompts: Sequence[str | list[int]], param: str = "prompt",
    truncated: bool = False,
) -> None:
    """400 for a prompt too long for max_model_len by its size alone: a text by its characters
    (without tokenizing it), token ids by their number. Names `param`, or `param[i]` of several.
    None with `truncate_prompt_tokens` (`truncated`): the engine keeps the prompt's end (the
    body's size limit bounds the text)."""
    if truncated:
        return
    for i, prompt in enumerate(prompts):
        name = param if len(prompts) == 1 else f"{param}[{i}]"
        if isinstance(prompt, str):
            ctx.check_text_size(len(prompt), name)
        else:
            ctx.check_ids_size(len(prompt), name)


def tokenize_prompts(ctx: ServerContext, prompts: list[str | list[int]],
                     truncated: bool = False, add_special_tokens: bool = True
                     ) -> list[list[int]]:
    """Token ids of every prompt (a worker thread for long texts: tokenize_prompts_async):
    every prompt checked by its size before any is tokenized, and by its number of tokens
    after (unless `truncated`: check_prompt_sizes). `add_special_tokens`: the tokenizer's own
    (a BOS) around each text, as vLLM's completions field says."""
    check_prompt_sizes(ctx, prompts, truncated=truncated)
    ids = [ctx.tokenizer.encode(p, add_special_tokens) if isinstance(p, str) else p
           for p in prompts]
    check_prompt_sizes(ctx, ids, truncated=truncated)
    return ids


async def tokenize_prompts_async(
    ctx: ServerContext, prompts: list[str | list[int]], truncated: bool = False,
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """`tokenize_prompts` on a worker thread, or on the loop when the texts are short."""
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    return await run_sized(chars, INLINE_TEXT_CHARS, tokenize_prompts, ctx, prompts, truncated,
                           add_special_tokens)


async def add_requests(
    ctx: ServerContext,
    request_id: str,
    prompts: list[str | list[int]],
    params: SamplingParams,
    constraint_param: str = "structured_outputs",
    prompt_ids: list[list[int]] | None = None,
    add_special_tokens: bool = True,
    priority: int = 0,
) -> list[RequestStream]:
    """Add one engine request per prompt (ids `{request_id}-{i}`); all or none.

    Text prompts are tokenized here (on a worker thread unless short: offload.py) unless
    `prompt_ids` (one list of ids per prompt) are given. Engine exceptions become APIErrors
    (400, 429, 503) before any response is sent; an invalid output constraint is a 400 naming
    `constraint_param` (the field that set it).
    """
    ctx.check_accepting()
    ctx.check_capacity(len(prompts) * params.n)
    if prompt_ids is None:
        prompt_ids = await tokenize_prompts_async(ctx, prompts,
                                                  params.truncate_prompt_tokens is not None,
                                                  add_special_tokens)
    if params.structured_outputs is not None:
        # Compile (or find cached) off the event loop and off the engine thread; a bad schema,
        # regex or grammar is a 400 here, before anything reaches the engine.
        try:
            await asyncio.to_thread(ctx.engine.engine.compile_grammar, params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), constraint_param) from None
    streams: list[RequestStream] = []
    try:
        for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await ctx.engine.add_request(rid, prompt, params, ids,
                                                        check_queue=i == 0, priority=priority))
    except BaseException as e:
        for stream in streams:
            stream.abort()
        if isinstance(e, Exception):
            raise from_exception(e) from None
        raise
    if ctx.log_requests:
        logger.info("request %s: %d prompt(s), %s", request_id, len(prompts), params)
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index.

    Leaving early (or an error in one stream) aborts every stream that is still running.
    """
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].abort()
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((i, output))
            merged.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            merged.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def collect_final(streams: list[RequestStream]) -> list[RequestOutput]:
    """The last (finished) output of every stream, in stream order."""
    finals: dict[int, RequestOutput] = {}
    async for i, output in merge_streams(streams):
        finals[i] = output
    return [finals[i] for i in range(len(streams))]


def check_stream_options(req: SamplingRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def include_usage(req: SamplingRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def usage(prompt_tokens: int, completion_tokens: int,
          outputs: Iterable[CompletionOutput] = ()) -> dict[str, Any]:
    """OpenAI's usage; with a prediction, its tokens accepted and rejected as drafts."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    predicted = [o for o in outputs if o.accepted_prediction_tokens is not None]
    if predicted:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(o.accepted_prediction_tokens for o in predicted),
            "rejected_prediction_tokens": sum(o.rejected_prediction_tokens for o in predicted)}
    return out


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def typed_sse(kind: str, **fields: Any) -> str:
    """An event of the Responses and Messages APIs' streams: named `kind`, its data typed so."""
    return f"event: {kind}\n{sse({'type': kind, **fields})}"


def token_counts(final: RequestOutput) -> tuple[int, int, int]:
    """A finished request's (prompt, output, prefix-cached prompt) tokens."""
    return (len(final.prompt_token_ids), sum(len(o.token_ids) for o in final.outputs),
            final.num_cached_tokens)


SSE_DONE = "data: [DONE]\n\n"


async def sse_guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn an exception mid-stream into an SSE error event, then always end with [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - headers are sent; the error must go in-band
        yield sse(from_exception(e).body())
    yield SSE_DONE


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` (a non-streaming handler body) but cancel it if the client disconnects.

    The body has been read already, so `receive()` only returns once the client goes away.
    Cancelling the handler closes its streams, which aborts the engine requests.
    """
    task = asyncio.ensure_future(work())

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        logger.info("client disconnected; request cancelled")
        raise APIError(499, "client disconnected")
    try:
        return task.result()
    except APIError:
        raise
    except Exception as e:  # engine errors (503, 500) as envelopes, without a traceback
        raise from_exception(e) from e
