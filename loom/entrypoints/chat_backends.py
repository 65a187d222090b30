"""Where `loom chat` gets its answers: an engine in this process, or a running server (--url).

Both stream an answer's text pieces for a list of messages and leave `stats` behind: tokens,
time to first token, decode speed, and how much of the prompt the prefix cache held.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.engine.llm_engine import LLMEngine

Messages = list[dict[str, str]]


class BackendError(RuntimeError):
    """The request failed (bad settings, too long a conversation, server error)."""


@dataclass
class AnswerStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    ttft_s: float | None = None
    decode_s: float = 0.0
    finish_reason: str | None = None

    def line(self) -> str:
        n = self.completion_tokens
        parts = [f"{n} token{'s' if n != 1 else ''}"]
        if self.completion_tokens > 1 and self.decode_s > 0:
            parts.append(f"{(self.completion_tokens - 1) / self.decode_s:.1f} tok/s")
        if self.ttft_s is not None:
            parts.append(f"TTFT {1000 * self.ttft_s:.0f} ms")
        parts.append(f"prompt {self.prompt_tokens}")
        if self.cached_tokens:
            parts.append(f"prefix cache {self.cached_tokens}")
        if self.finish_reason and self.finish_reason != "stop":
            parts.append("stopped" if self.finish_reason == "abort" else self.finish_reason)
        return " · ".join(parts)


class _Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def token(self) -> None:
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last

    def fill(self, stats: AnswerStats) -> None:
        if self.first is not None and self.last is not None:
            stats.ttft_s = self.first - self.start
            stats.decode_s = self.last - self.first


class LocalBackend:
    """An LLMEngine in this process, stepped here; `stopped()` is checked between steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model = engine.model_name
        self.stats = AnswerStats()
        self._count = 0

    def stream(self, messages: Messages, settings: dict[str, Any],
               stopped: Callable[[], bool]) -> Iterator[str]:
        from loom.sampling_params import SamplingParams

        try:
            params = SamplingParams(**settings)
            prompt = self.engine.tokenizer.encode_chat(messages)
            self._count += 1
            request_id = f"chat-{self._count}"
            timer = _Timer()
            self.engine.add_request(request_id, prompt, params)
        except ValueError as e:  # InvalidRequestError, SamplingParamsError, ChatTemplateError
            raise BackendError(str(e)) from None
        self.stats = stats = AnswerStats(prompt_tokens=len(prompt))
        try:
            while self.engine.has_unfinished_requests():
                if stopped():
                    self.engine.abort_request(request_id)
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    o = out.outputs[0]
                    stats.completion_tokens = len(o.token_ids)
                    stats.cached_tokens = out.num_cached_tokens
                    if out.finished:
                        stats.finish_reason = o.finish_reason
                    if o.delta_text:
                        timer.token()
                        yield o.delta_text
        finally:  # closed early: drop the request, leave the engine empty
            self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            timer.fill(stats)


class RemoteBackend:
    """A running Loom (or any OpenAI-compatible) server's /v1/chat/completions, streamed."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None) -> None:
        import httpx

        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers,
                                   timeout=httpx.Timeout(600, connect=10))
        self.model = model or self._first_model()
        self.stats = AnswerStats()

    def _first_model(self) -> str:
        import httpx

        try:
            r = self.client.get("/v1/models")
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise BackendError(f"cannot list the models of {self.url}: {e}") from None

    def stream(self, messages: Messages, settings: dict[str, Any],
               stopped: Callable[[], bool]) -> Iterator[str]:
        import httpx

        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True},
                **{k: v for k, v in settings.items() if v is not None}}
        self.stats = stats = AnswerStats()
        timer = _Timer()
        thinking = False  # inside a reasoning_content block: shown as the model wrote it
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise BackendError(_error_text(r))
                for line in r.iter_lines():
                    if stopped():  # leaving the stream closes it: the server aborts
                        stats.finish_reason = "abort"
                        break
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise BackendError(event["error"].get("message", str(event)))
                    if event.get("usage"):
                        u = event["usage"]
                        stats.prompt_tokens = u.get("prompt_tokens", 0)
                        stats.completion_tokens = u.get("completion_tokens", 0)
                        stats.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                            "cached_tokens")
                    for choice in event.get("choices") or []:
                        stats.finish_reason = choice.get("finish_reason") or stats.finish_reason
                        parts = choice.get("delta") or {}
                        thought, answer = parts.get("reasoning_content"), parts.get("content")
                        delta = ""  # a split-off thinking block (--reasoning-parser) rejoined
                        if thought:
                            delta, thinking = ("" if thinking else "<think>") + thought, True
                        if answer:
                            delta += ("</think>\n\n" if thinking else "") + answer
                            thinking = False
                        if delta:
                            timer.token()
                            stats.completion_tokens += 1  # the usage event, last, has the count
                            yield delta
        except httpx.HTTPError as e:
            raise BackendError(f"{self.url}: {e}") from None
        finally:
            timer.fill(stats)


def _error_text(r: Any) -> str:
    try:
        return f"{r.status_code}: {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text[:200]}"
