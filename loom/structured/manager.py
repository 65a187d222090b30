"""Structured output for one engine: compiles constraints (cached), gives each constrained
request its matcher, and builds the per-step token bitmask for the constrained rows only.

Compilation is thread-safe and cached by the constraint's key, so the server compiles on a
worker thread while validating a request and the engine thread only ever finds it cached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from loom.request import CONSTRAINT_FAILED
from loom.structured.backend import (
    CompiledGrammar, GrammarError, GrammarMatcher, LLGuidanceBackend,
)

if TYPE_CHECKING:
    from loom.core.sched_output import SchedulerOutput
    from loom.request import Request
    from loom.structured.params import StructuredOutputsParams
    from loom.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["GrammarError", "StructuredOutputManager"]


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: LLGuidanceBackend | None = None  # built on first use (about 1 s)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._cache_size = cache_size
        self.num_words = (vocab_size + 31) // 32

    @property
    def backend(self) -> LLGuidanceBackend:
        with self._lock:
            if self._backend is None:
                t0 = time.perf_counter()
                self._backend = LLGuidanceBackend(self._tokenizer, self.vocab_size)
                logger.info("grammar engine ready in %.2f s", time.perf_counter() - t0)
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint (cached); raises GrammarError naming the problem."""
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            backend = self.backend
            t0 = time.perf_counter()
            try:
                hit = backend.compile(params)
            except GrammarError as e:
                hit = e
            logger.debug("compiled a %s constraint in %.1f ms", params.kind,
                         (time.perf_counter() - t0) * 1e3)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def grammar_bitmask(
        self, so: SchedulerOutput, requests: dict[str, Request], failed: dict[str, str]
    ) -> tuple[torch.Tensor, dict[str, int]] | None:
        """Bitmask rows for the constrained requests that sample this step, or None if none do.

        A request samples when this step reaches the end of its known tokens (the runner's
        rule). One with a speculative draft of k tokens gets 1 + k consecutive rows: row i is
        the mask after draft tokens 0..i-1 (the matcher goes through the draft, then rolls it
        back; the scheduler proposed only tokens the grammar allows). Returns (bitmask
        [rows, words] int32, req_id -> its first row). A request whose grammar fails here (a
        limit of the grammar engine) goes into `failed` (req_id -> reason) with all-zero rows,
        and the others go on.
        """
        drafts = so.scheduled_spec_decode_tokens
        rows: dict[str, int] = {}
        num_rows = 0
        for req_id, n in so.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None or request.grammar is None:
                continue
            k = len(drafts.get(req_id, ()))
            if request.num_computed_tokens + n - k == request.num_tokens:
                rows[req_id] = num_rows
                num_rows += 1 + k
        if not rows:
            return None
        bitmask = torch.empty((num_rows, self.num_words), dtype=torch.int32)
        for req_id, row in rows.items():
            draft = drafts.get(req_id, [])
            try:
                error = _fill_rows(requests[req_id].grammar, draft, bitmask, row)
            except Exception as e:  # noqa: BLE001 - this request's error alone
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                bitmask[row : row + 1 + len(draft)] = 0
                failed[req_id] = f"{CONSTRAINT_FAILED}: {error}"
        return bitmask, rows


def _fill_rows(grammar: GrammarMatcher, draft: list[int], bitmask: torch.Tensor,
               row: int) -> str | None:
    """Fill bitmask rows row .. row + len(draft): the masks before each draft token and after
    the last; the grammar's state is left as it was. Returns the grammar's error, if any."""
    grammar.fill_bitmask(bitmask, row)
    accepted = 0
    for i, token in enumerate(draft):
        if grammar.error is not None or not grammar.accept_token(token):
            break
        accepted += 1
        grammar.fill_bitmask(bitmask, row + 1 + i)
    error = grammar.error
    grammar.rollback(accepted)
    if error is None and accepted < len(draft):
        error = f"draft token {draft[accepted]} is not allowed"
    return error
