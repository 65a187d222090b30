"""One streamed OpenAI-compatible request, timed chunk by chunk.

Every server-sent event whose choice carries text is one timestamp in `chunk_times` (seconds on
the benchmark's clock, `time.perf_counter()` minus its start). TTFT, ITL, TPOT and end-to-end
latency are all derived from these timestamps and `start` / `end`, so they can be checked
against the raw record. A chunk may hold more than one token (a server may batch them, or hold
back an incomplete UTF-8 character); ITL is then per chunk, as in vLLM's `bench serve`.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class RequestInput:
    index: int
    prompt: str
    prompt_len: int  # tokens, as the bench tokenizer counts them
    output_len: int  # max_tokens


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times are seconds since the benchmark started."""

    index: int
    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    output_tokens: int = 0  # from the server's usage, else counted with the tokenizer
    prompt_tokens: int | None = None  # from the server's usage
    usage_reported: bool = False
    finish_reason: str | None = None
    success: bool = False
    status_code: int | None = None
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a one-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {s: getattr(self, s) for s in self.__slots__}


def build_payload(
    endpoint: str, model: str, req: RequestInput, ignore_eos: bool, stream_usage: bool,
    temperature: float = 0.0,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len,
                            "temperature": temperature, "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if stream_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def error_message(status: int, body: bytes) -> str:
    """`HTTP 400: <the server's message>` from an OpenAI, FastAPI or plain-text error body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = str(err)
    return f"HTTP {status}: {text[:300] or '(empty body)'}"


def _choice_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def _read_stream(resp: httpx.Response, rec: RequestRecord, endpoint: str, t0: float) -> None:
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        now = time.perf_counter() - t0
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            rec.error = f"bad stream data: {data[:200]!r}"
            return
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            rec.error = f"error in stream: {msg}"
            return
        for choice in obj.get("choices") or []:
            text = _choice_text(choice, endpoint)
            if text:
                rec.chunk_times.append(now)
                rec.generated_text += text
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            rec.output_tokens = int(usage["completion_tokens"])
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.usage_reported = True
    if not done and rec.finish_reason is None:
        rec.error = "the stream ended before [DONE]"
    elif not rec.chunk_times:
        rec.error = "the response held no output tokens"
    else:
        rec.success = True


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], req: RequestInput,
    endpoint: str, t0: float,
) -> RequestRecord:
    """POST one streaming request; never raises for server or network failures."""
    rec = RequestRecord(index=req.index, prompt_len=req.prompt_len, output_len=req.output_len)
    rec.start = time.perf_counter() - t0
    try:
        async with client.stream("POST", url, json=payload) as resp:
            rec.status_code = resp.status_code
            if resp.status_code != 200:
                rec.error = error_message(resp.status_code, await resp.aread())
            elif "text/event-stream" not in resp.headers.get("content-type", ""):
                await resp.aread()
                rec.error = ("the server did not stream (Content-Type: "
                             f"{resp.headers.get('content-type', 'none')})")
            else:
                await _read_stream(resp, rec, endpoint, t0)
    except httpx.ConnectError as e:
        rec.error = f"cannot connect to {url}: {e or type(e).__name__}"
    except httpx.TimeoutException as e:
        rec.error = f"timed out ({type(e).__name__})"
    except httpx.HTTPError as e:  # the server died mid-stream, a protocol error, ...
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter() - t0
    return rec
