"""The server backend: any OpenAI-compatible `/v1/completions` endpoint, over httpx.

Generations stream from `/v1/completions` (text prompt, vLLM-style extras only when a program
uses them: `top_k`, `ignore_eos`, `structured_outputs`). `select` on Loom's server is exact:
the prompt and each choice are tokenized by `/tokenize`, and all choices go in ONE completions
request (`prompt` = their token-id lists, `echo` + `logprobs: 0` + `max_tokens: 0`), so they
are scheduled together and scored from their prompt logprobs. A server without those extras
answers 4xx; `select` then falls back to a greedy generation matched against the choices and
warns (LangFallbackWarning); its metadata says `exact=False`.

Chat roles need the model's template, which the OpenAI API does not expose: pass
`chat_template` (Jinja text or a ChatTemplate) or `tokenizer` (a Loom model spec whose
tokenizer is loaded here, e.g. "smollm2").
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from loom.lang.backend import Backend, ChoiceScores, GenResult, OnDelta, scored_span
from loom.lang.errors import LangError, LangFallbackWarning
from loom.lang.template import ChatTemplate

if TYPE_CHECKING:
    from loom.lang.ir import GenSpec
    from loom.tokenizer.tokenizer import Tokenizer

_FALLBACK_STATUS = (400, 404, 405, 422, 501)


class OpenAIBackend(Backend):
    """Programs on a server at `base_url` (e.g. "http://127.0.0.1:8000/v1").

    `exact_select`: None tries echo-logprob scoring and falls back (with a warning) if the
    server refuses it; False always falls back; True never does (a refusal raises).
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 chat_template: str | ChatTemplate | None = None,
                 tokenizer: str | Tokenizer | None = None, exact_select: bool | None = None,
                 timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._root = self.base_url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.model = model or self._first_model()
        self.exact_select = exact_select
        self.chat_template = _template(chat_template, tokenizer)

    def close(self) -> None:
        self.client.close()

    def _first_model(self) -> str:
        data = self._check(self.client.get(f"{self.base_url}/models")).json()
        models = data.get("data") or []
        if not models:
            raise LangError(f"{self.base_url}/models lists no model; pass model=")
        return models[0]["id"]

    @staticmethod
    def _check(response: httpx.Response) -> httpx.Response:
        if response.status_code != 200:
            response.read()
            raise LangError(f"the server answered {response.status_code}: {response.text[:500]}")
        return response

    # ---- gen ------------------------------------------------------------------------------

    def _body(self, prompt: str, spec: GenSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": spec.max_tokens,
            "temperature": spec.temperature, "top_p": spec.top_p, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }
        optional = {"top_k": spec.top_k or None, "seed": spec.seed, "stop": list(spec.stop) or None,
                    "ignore_eos": spec.ignore_eos or None,
                    "structured_outputs": spec.structured_outputs()}
        body.update({k: v for k, v in optional.items() if v is not None})
        return body

    def generate(self, prompt: str, spec: GenSpec, on_delta: OnDelta | None = None) -> GenResult:
        text, logprobs = [], []
        finish: str | None = None
        usage: dict[str, Any] = {}
        url = f"{self.base_url}/completions"
        with self.client.stream("POST", url, json=self._body(prompt, spec)) as response:
            self._check(response)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:  # the server failed after its 200 went out
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    raise LangError(f"the server failed mid-stream: {message}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        text.append(choice["text"])
                        if on_delta is not None:
                            on_delta(choice["text"])
                    lp = choice.get("logprobs") or {}
                    logprobs.extend(v for v in lp.get("token_logprobs") or [] if v is not None)
                    finish = choice.get("finish_reason") or finish
        details = usage.get("prompt_tokens_details") or {}
        return GenResult("".join(text), finish, usage.get("prompt_tokens", 0),
                         usage.get("completion_tokens", len(logprobs)), logprobs,
                         details.get("cached_tokens"))

    # ---- select ---------------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int] | None:
        r = self.client.post(f"{self._root}/tokenize", json={"model": self.model, "prompt": text})
        if r.status_code in _FALLBACK_STATUS and self.exact_select is None:
            return None
        return self._check(r).json()["tokens"]

    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        if self.exact_select is not False:
            scores = self._score_exact(prompt, choices)
            if scores is not None:
                return scores
        reason = "told not to score" if self.exact_select is False else "cannot score prompts"
        warnings.warn(f"{self.base_url}: {reason} (echo + logprobs); select falls back to a "
                      "greedy generation matched against the choices", LangFallbackWarning,
                      stacklevel=2)
        return self._score_by_generation(prompt, choices)

    def _score_exact(self, prompt: str, choices: Sequence[str]) -> ChoiceScores | None:
        prefix = self._tokenize(prompt)
        full = [self._tokenize(prompt + c) for c in choices] if prefix is not None else []
        if prefix is None or any(ids is None for ids in full):
            return None
        start = scored_span(prefix, full)  # type: ignore[arg-type]
        body = {"model": self.model, "prompt": full, "max_tokens": 0, "echo": True,
                "logprobs": 0, "temperature": 0.0}
        r = self.client.post(f"{self.base_url}/completions", json=body)
        if r.status_code in _FALLBACK_STATUS and self.exact_select is None:
            return None
        answer = sorted(self._check(r).json()["choices"], key=lambda c: c["index"])
        token_lps = [[v for v in c["logprobs"]["token_logprobs"][start:] if v is not None]
                     for c in answer]
        return ChoiceScores.from_token_logprobs(choices, token_lps)

    def _score_by_generation(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        """The fallback: generate greedily and take the choice the output matches best (the
        one it starts with, else the longest common prefix; first of equals)."""
        from loom.lang.ir import GenSpec

        spec = GenSpec(max_tokens=max(len(c) for c in choices), temperature=0.0)
        out = self.generate(prompt, spec).text

        def match(choice: str) -> int:
            if out.startswith(choice):
                return len(out) + 1
            n = 0
            while n < min(len(out), len(choice)) and out[n] == choice[n]:
                n += 1
            return n

        best = max(range(len(choices)), key=lambda i: match(choices[i]))
        logprobs: list[float | None] = [0.0 if i == best else None for i in range(len(choices))]
        return ChoiceScores(list(choices), logprobs, [[] for _ in choices], exact=False)


def _template(chat_template: str | ChatTemplate | None,
              tokenizer: str | Tokenizer | None) -> ChatTemplate | None:
    if isinstance(chat_template, ChatTemplate):
        return chat_template
    if isinstance(chat_template, str):
        return ChatTemplate.from_jinja(chat_template)
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str):
        from loom.loader.resolve import resolve_model
        from loom.tokenizer.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_source(resolve_model(tokenizer))
    return ChatTemplate.from_tokenizer(tokenizer)
