"""The in-process backend: Loom's engine behind an AsyncEngine on a private event loop.

Program threads hand coroutines to the loop; the AsyncEngine's engine thread drains every
request queued since its last step before stepping, so requests made together (a program's
forks, `run_batch`'s programs, a select's choices) are scheduled in the same steps and the
prefix cache shares their common blocks. A select's choices ask for prompt logprobs only from
where they differ (`prompt_logprobs_start`), so their common prefix is computed once too.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from loom.engine.async_engine import AsyncEngine
from loom.lang.backend import Backend, ChoiceScores, GenResult, OnDelta, scored_span
from loom.lang.template import ChatTemplate
from loom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loom.engine.llm import LLM
    from loom.engine.outputs import RequestOutput
    from loom.lang.ir import GenSpec

_ids = itertools.count()


def sampling_params(spec: GenSpec) -> SamplingParams:
    """The engine's parameters for one `gen` (logprobs of the sampled tokens are always kept)."""
    return SamplingParams(
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
        max_tokens=spec.max_tokens, stop=list(spec.stop), ignore_eos=spec.ignore_eos, logprobs=0,
        structured_outputs=spec.structured_outputs(),
    )


class EngineBackend(Backend):
    """Runs programs on an `LLM` (made from `engine_kwargs` when not given).

    While the backend is open its engine belongs to it: do not call `llm.generate` at the same
    time. `close()` (or `with`) stops the loop; the LLM stays usable afterwards.
    """

    def __init__(self, llm: LLM | None = None, **engine_kwargs: Any) -> None:
        if llm is None:
            from loom.engine.llm import LLM

            llm = LLM(**engine_kwargs)
        self.llm = llm
        self.tokenizer = llm.engine.tokenizer
        self.chat_template = ChatTemplate.from_tokenizer(self.tokenizer)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loom-lang-loop",
                                        daemon=True)
        self._thread.start()
        self.async_engine = AsyncEngine(llm.engine)
        self._call(self._start())

    async def _start(self) -> None:
        self.async_engine.start()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self.async_engine.shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(tokens looked up, tokens found) in the engine's prefix cache, cumulative."""
        stats = self.llm.engine.scheduler.prefix_cache_stats
        return stats.queries, stats.hits

    async def _generate(self, prompt: str | list[int], params: SamplingParams,
                        on_delta: OnDelta | None) -> RequestOutput:
        last = None
        async for out in self.async_engine.generate(prompt, params, f"lang-{next(_ids)}"):
            delta = out.outputs[0].delta_text
            if on_delta is not None and delta:
                on_delta(delta)
            last = out
        assert last is not None and last.finished
        return last

    def generate(self, prompt: str, spec: GenSpec, on_delta: OnDelta | None = None) -> GenResult:
        out = self._call(self._generate(prompt, sampling_params(spec), on_delta))
        o = out.outputs[0]
        return GenResult(
            text=o.text, finish_reason=o.finish_reason, prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(o.token_ids), logprobs=[lp.logprobs[0] for lp in o.logprobs or []],
            cached_tokens=out.num_cached_tokens,
        )

    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        prefix = self.tokenizer.encode(prompt)
        full = [self.tokenizer.encode(prompt + c) for c in choices]
        start = scored_span(prefix, full)
        # the prefix cache may serve what comes before `start` (the choices share it)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                                prompt_logprobs_start=start)

        async def score_all() -> list[RequestOutput]:
            return await asyncio.gather(*(self._generate(ids, params, None) for ids in full))

        token_lps = []
        for out in self._call(score_all()):
            entries = out.prompt_logprobs or []
            token_lps.append([lp.logprobs[0] for lp in entries[start:] if lp is not None])
        return ChoiceScores.from_token_logprobs(choices, token_lps)
