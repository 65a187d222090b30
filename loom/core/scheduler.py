"""The scheduler: one token-budget rule for prefill, chunked prefill, prefix hits and decode.

Every step each request asks for `num_tokens - num_computed_tokens` tokens, capped by the step's
token budget (`max_num_batched_tokens`). Running requests go first, in order; when blocks run
out the newest running request is preempted (blocks freed, recomputed later from the front of
the waiting queue). Waiting requests are then admitted first come, first served while budget,
`max_num_seqs` and blocks allow. The scheduler holds integers only; the runner owns tensors.

With the "priority" policy (vLLM's `--scheduling-policy priority`) both queues are ordered by
(priority, arrival time), lower first: requests are admitted and run in that order, the victim
of a preemption is the last running request (the lowest priority, newest), and a waiting request
that cannot be admitted (`max_num_seqs` or blocks) preempts running requests of strictly lower
priority, lowest first, until it can.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loom.block_hash import extend_block_hashes
from loom.core.outputs import EngineCoreOutput
from loom.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from loom.request import CONSTRAINT_FAILED, RequestStatus

if TYPE_CHECKING:
    import torch

    from loom.config import SchedulerConfig
    from loom.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
    from loom.core.spec_decode import SpecDecoder
    from loom.core.sched_output import Logprobs, ModelRunnerOutput
    from loom.request import Request

logger = logging.getLogger(__name__)

__all__ = ["EngineCoreOutput", "RequestRejectedError", "Scheduler", "check_stop"]


class RequestRejectedError(ValueError):
    """A request that could never be scheduled (too long for the model or the KV cache)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {message}")
        self.request_id = request_id


def check_stop(request: Request, max_model_len: int) -> bool:
    """After a token was appended: set the final status and return True if the request is done.

    Order: stop_token_ids, then eos (both only once min_tokens outputs exist; eos not with
    ignore_eos), then a completed structured output, then max_tokens, then max_model_len.
    """
    params = request.sampling_params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
    if request.grammar is not None and request.grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED  # the structured output is complete
        return True
    max_tokens = request.max_tokens
    if (max_tokens is not None and num_output >= max_tokens) or (
        request.num_tokens >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def _rank(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival_time


def _insert_by_rank(queue: deque[Request] | list[Request], request: Request) -> None:
    """Into a queue kept in _rank order, after its equals (searched from the back, where
    arrivals usually land)."""
    i = len(queue)
    while i and _rank(queue[i - 1]) > _rank(request):
        i -= 1
    queue.insert(i, request)


@dataclass(slots=True)
class _Step:
    """What one schedule() call has decided so far."""

    token_budget: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # speculative drafts
    spec_probs: dict[str, torch.Tensor] = field(default_factory=dict)  # sampled drafts' q

    def add(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens


class Scheduler:
    """Decides which requests run each step and how many tokens each computes.

    Invariants: a request is in exactly one of `waiting` (WAITING or PREEMPTED, holding no
    blocks) and `running` (RUNNING); `requests` maps the ids of both; finished requests are
    dropped from all three at once and their blocks freed.
    """

    def __init__(
        self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager, block_size: int,
        spec: SpecDecoder | None = None,
    ) -> None:
        if kv_cache_manager.block_size != block_size:
            raise ValueError(
                f"block_size {block_size} != KV cache manager's {kv_cache_manager.block_size}"
            )
        self.scheduler_config = scheduler_config
        self.by_priority = scheduler_config.policy == "priority"
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids whose runner state must go before the next step (finished, aborted, preempted),
        # and those of them that were preempted (the runner keeps their sampling generators).
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self.spec = spec  # speculative decoding (loom.core.spec_decode), None: off
        self.decode_steps = 1  # num_scheduler_steps (the engine sets it)
        # With a bound (seconds): steps ahead only as many as fit in it by the measured time of
        # a decode step (None: decode_steps whatever the time)
        self.ahead_budget_s: float | None = None
        # A hybrid model with prefix caching: prompts' prefills end on their last block
        # boundary and the steps that end on one are named (SchedulerOutput.state_keys)
        self.state_boundaries = False
        self.decode_step_s: float | None = None  # a decode-only step's time, smoothed

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestRejectedError at once if it can never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self._resolve_max_tokens(request)
        if self.kv_cache_manager.enable_caching:
            request.enable_block_hashing(self.block_size)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at the back (`front`: a preempted request, at the front), or
        under the priority policy in (priority, arrival) order, after its equals."""
        if self.by_priority:
            _insert_by_rank(self.waiting, request)
        else:
            self.waiting.appendleft(request) if front else self.waiting.append(request)

    def _resolve_max_tokens(self, request: Request) -> None:
        """Reject requests too long for max_model_len or the whole cache; with max_tokens None,
        cap the output at what both allow."""
        rid, bs = request.request_id, self.block_size
        num_prompt = request.num_prompt_tokens
        usable = self.kv_cache_manager.num_usable_blocks
        if num_prompt == 0:
            raise RequestRejectedError(rid, "the prompt is empty")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            total = num_prompt + max_tokens
            if total > self.max_model_len:
                raise RequestRejectedError(
                    rid, f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} "
                    f"exceeds max_model_len ({self.max_model_len})",
                )
            num_blocks = -(-total // bs)
            if num_blocks > usable:
                raise RequestRejectedError(
                    rid, f"{total} tokens need {num_blocks} KV blocks of {bs} tokens but the "
                    f"cache has only {usable}",
                )
            request.max_tokens = max_tokens
            return
        # No max_tokens: the prompt must leave room for at least one output token.
        limit = min(self.max_model_len, usable * bs)
        if num_prompt >= limit:
            raise RequestRejectedError(
                rid, f"prompt ({num_prompt} tokens) leaves no room for output within "
                f"max_model_len ({self.max_model_len}) and the KV cache ({usable} blocks of {bs})",
            )
        request.max_tokens = limit - num_prompt

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; see the module docstring for the rule."""
        step = _Step(token_budget=self.max_num_batched_tokens)
        if self.by_priority:
            self._preempt_for_waiting()
        if self.spec is not None:
            self.spec.prepare(self.running)  # a draft model's drafts, batched
        self._schedule_running(step)
        # A step that preempted admits nobody: the freed blocks go to the running requests.
        if not step.preempted:
            self._schedule_waiting(step)
        finished, self.finished_req_ids = self.finished_req_ids, set()
        preempted, self.preempted_req_ids = self.preempted_req_ids, set()
        state_keys = self._state_keys(step) if self.state_boundaries else {}
        return SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.token_budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=step.spec_tokens,
            spec_decode_probs=step.spec_probs,
            lookahead=self._lookahead(step),
            state_keys=state_keys,
        )

    def _state_keys(self, step: _Step) -> dict[str, object]:
        """req_id -> the hash of the block its step ends on, where it ends on one; for a step
        with a draft, of the last block that ends within it, its tokens those the draft would
        make (the runner keeps the states there if it keeps the draft's tokens up to it)."""
        keys = {}
        for req_id, n in step.num_scheduled_tokens.items():
            request = self.requests[req_id]
            c = request.num_computed_tokens
            draft = step.spec_tokens.get(req_id)
            end = c + n if draft is None else (c + n) // self.block_size * self.block_size
            key = self._block_ending_at(request, end, draft) if end > c else None
            if key is not None:
                keys[req_id] = key
        return keys

    def _block_ending_at(self, request: Request, end: int, draft: list[int] | None = None
                         ) -> object:
        """The hash of the request's block that ends at token `end` (its tokens then `draft`:
        a block the draft completes), or None where no full block does."""
        bs = self.block_size
        if end % bs or end <= 0:
            return None
        if end // bs <= len(request.block_hashes):
            return request.block_hashes[end // bs - 1]
        if not draft or end > request.num_tokens + len(draft):
            return None
        hashes = list(request.block_hashes)
        extend_block_hashes(hashes, request.all_token_ids + draft, bs, request.extra_keys)
        return hashes[end // bs - 1]

    def _to_boundary(self, request: Request, num_new: int, start: int | None = None) -> int:
        """`num_new` tokens from `start` (default: the request's computed ones), cut to end on
        the last block boundary before its last token where they would cross it (a hybrid's
        states are kept there, for a later prefix hit)."""
        if not self.state_boundaries:
            return num_new
        if start is None:
            start = request.num_computed_tokens
        boundary = (request.num_tokens - 1) // self.block_size * self.block_size
        return boundary - start if start < boundary < start + num_new else num_new

    def _lookahead(self, step: _Step) -> int:
        """Decode steps past this one the runner may run (SchedulerOutput.lookahead): where
        every running request decodes one token greedily by the argmax alone (no logprobs,
        penalties, grammar, pooling or draft), nobody waits or was preempted, and each has the
        room (max_tokens, max_model_len, KV blocks: allocated here, never by preempting)."""
        most = self.decode_steps - 1
        if self.ahead_budget_s is not None:  # none until a decode step was timed
            t = self.decode_step_s
            most = 0 if t is None else min(most, int(self.ahead_budget_s / t) - 1)
        if (most <= 0 or not self.running or self.waiting or step.new_reqs or step.preempted
                or step.spec_tokens):
            return 0
        for request in self.running:  # one left out of the step (None) has none either
            if (step.num_scheduled_tokens.get(request.request_id) != 1
                    or request.num_tokens - request.num_computed_tokens != 1
                    or not request.sampling_params.argmax_only or request.grammar is not None
                    or request.sampling_params.pooling is not None):
                return 0
            most = min(most, self.max_model_len - request.num_tokens - 1)
            if request.max_tokens is not None:
                most = min(most, request.max_tokens - request.num_output_tokens - 1)
            if self.state_boundaries:  # no step past this one ends on a block boundary: the
                # step that does is a scheduled one, whose states are kept (state_keys)
                end = request.num_computed_tokens + 1
                most = min(most, (end // self.block_size + 1) * self.block_size - end - 1)
        if most <= 0:
            return 0
        kv = self.kv_cache_manager
        added: list[list[int]] = []
        for i, request in enumerate(self.running):
            blocks = kv.allocate_slots(request, 1 + most)
            if blocks is None:
                for done in self.running[:i]:  # back to the step's one token
                    kv.trim(done, done.num_computed_tokens + 1)
                return 0
            added.append([block.block_id for block in blocks])
        cached = step.cached_reqs
        at = {req_id: j for j, req_id in enumerate(cached.req_ids)}
        for request, ids in zip(self.running, added):
            cached.new_block_ids[at[request.request_id]].extend(ids)
        return most

    def _schedule_running(self, step: _Step) -> None:
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                step.token_budget,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                req_index += 1
                continue
            num_new = self._to_boundary(request, num_new)
            draft = self._propose(request, step)
            if draft and (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new + len(draft))) is not None:
                step.spec_tokens[request.request_id] = draft
                probs = None if self.spec is None else self.spec.draft_probs(
                    request.request_id, len(draft))
                if probs is not None:
                    step.spec_probs[request.request_id] = probs
                num_new += len(draft)
            else:  # no draft, or no blocks for it: never preempt for a draft
                new_blocks = None
            while new_blocks is None and (
                    new_blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
                victim = self._preempt_newest(step)
                if victim is request:
                    break
            if new_blocks is None:
                # It preempted itself; it was the last running request, so the loop ends.
                break
            cached = step.cached_reqs
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([block.block_id for block in new_blocks])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            step.add(request, num_new)
            req_index += 1

    def _propose(self, request: Request, step: _Step) -> list[int]:
        """A speculative draft for a request about to decode (its last token alone is new)."""
        if self.spec is None or request.num_tokens - request.num_computed_tokens != 1:
            return []
        return self.spec.propose(request, len(self.running), step.token_budget - 1)

    def _preempt_newest(self, step: _Step) -> Request:
        """Preempt the newest running request (by priority: the lowest, newest): free its
        blocks, requeue it at the front (by priority: in its place)."""
        victim = self._preempt_last()
        step.preempted.append(victim)
        step.spec_tokens.pop(victim.request_id, None)
        step.spec_probs.pop(victim.request_id, None)
        return victim

    def _preempt_last(self) -> Request:
        victim = self.running.pop()
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue(victim, front=True)
        self.finished_req_ids.add(victim.request_id)
        self.preempted_req_ids.add(victim.request_id)
        return victim

    def _preempt_for_waiting(self) -> None:
        """The priority policy, before the step: while the first waiting request outranks the
        last running one and cannot be admitted (`max_num_seqs` reached, or fewer free blocks
        than its prompt's first chunk needs, prefix hits aside), preempt the last running one.
        The step then runs as any other: the freed room goes to the best-ranked requests."""
        if not self.waiting:
            return
        head, bs = self.waiting[0], self.block_size
        need = -(-min(head.num_tokens, self.max_num_batched_tokens) // bs)
        while self.running and head.priority < self.running[-1].priority and (
                len(self.running) >= self.max_num_seqs
                or self.kv_cache_manager.num_free_blocks < need):
            victim = self._preempt_last()
            logger.debug("request %s (priority %d) preempted for %s (priority %d)",
                         victim.request_id, victim.priority, head.request_id, head.priority)

    def _schedule_waiting(self, step: _Step) -> None:
        kv = self.kv_cache_manager
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # Waiting requests hold no blocks (preemption freed them), so look up the cache.
            assert not kv.get_block_ids(request.request_id), f"{request} holds blocks"
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = min(
                request.num_tokens - num_hit, step.token_budget, self.max_model_len - num_hit
            )
            if num_new <= 0:
                break
            num_new = self._to_boundary(request, num_new, num_hit)
            if kv.allocate_slots(request, num_new, computed_blocks, num_hit) is None:
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self._run(request)
            step.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    state_key=(self._block_ending_at(request, num_hit)
                               if self.state_boundaries else None),
                )
            )
            step.add(request, num_new)

    def _run(self, request: Request) -> None:
        """Into `running`: at the end, or under the priority policy in (priority, arrival)
        order (so that the last running request is always the one to preempt)."""
        if self.by_priority:
            _insert_by_rank(self.running, request)
        else:
            self.running.append(request)

    def observe_step(self, so: SchedulerOutput, seconds: float) -> None:
        """A step's time, from the engine: of a decode-only step (every scheduled request one
        token, no draft), per forward, smoothed into decode_step_s (the bound of steps ahead)."""
        if (self.ahead_budget_s is None or so.scheduled_new_reqs
                or so.scheduled_spec_decode_tokens or not so.num_scheduled_tokens
                or so.total_num_scheduled_tokens != len(so.num_scheduled_tokens)):
            return
        t = seconds / (1 + so.lookahead)
        prev = self.decode_step_s
        self.decode_step_s = t if prev is None else 0.8 * prev + 0.2 * t

    # ---- results ---------------------------------------------------------------------------

    def update_from_output(
        self, sched_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply stop rules, free finished
        requests. Returns one output per request that got tokens (or prompt logprobs)."""
        index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for req_id, num_scheduled in sched_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished or aborted since schedule()
            error = runner_output.failed.get(req_id)
            if error is not None:  # this request alone failed; the rest of the batch goes on
                outputs.append(self._fail(request, error))
                any_finished = True
                continue
            start = request.num_computed_tokens
            request.num_computed_tokens += num_scheduled
            i = index.get(req_id)
            if sched_output.lookahead and i is not None:  # the KV of all but the last token
                request.num_computed_tokens += len(runner_output.sampled_token_ids[i]) - 1
            draft = sched_output.scheduled_spec_decode_tokens.get(req_id)
            if draft:
                sampled = [] if i is None else runner_output.sampled_token_ids[i]
                self._roll_back(request, draft, sampled)
            if i is None:
                continue
            output = self._apply_sampled(request, runner_output, i, start)
            if draft:  # the blocks its kept draft filled, hashed only now
                self.kv_cache_manager.cache_computed(request)
            if output is None:
                continue
            outputs.append(output)
            if output.finish_reason is not None:
                self._free_request(request, had_runner_state=True)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _apply_sampled(
        self, request: Request, runner_output: ModelRunnerOutput, i: int, start: int
    ) -> EngineCoreOutput | None:
        """The step's sampled tokens (stop rules token by token) and prompt logprobs, whose
        first entry is prompt token `start` + 1 (0 where the step started at 0)."""
        new_token_ids: list[int] = []
        for token_id in runner_output.sampled_token_ids[i]:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            if request.grammar is not None and not request.grammar.accept_token(token_id):
                # The bitmask allowed the token, so the grammar engine failed on its own (a
                # limit it hit only now): this request's error, reported to its client.
                error = request.grammar.error or f"token {token_id} rejected"
                logger.warning("request %s: its output constraint failed: %s",
                               request.request_id, error)
                request.status = RequestStatus.FINISHED_ERROR
                return self._core_output(request, new_token_ids, None, None,
                                         f"{CONSTRAINT_FAILED}: {error}")
            if check_stop(request, self.max_model_len):
                break
        logprobs = runner_output.logprobs[i] if i < len(runner_output.logprobs) else None
        if logprobs is not None:  # a stop mid-step drops the tokens after it
            logprobs = logprobs[: len(new_token_ids)]
        prompt_logprobs = (
            runner_output.prompt_logprobs[i] if i < len(runner_output.prompt_logprobs) else None
        )
        if prompt_logprobs is not None:  # after a preemption: the tokens not sent yet alone
            first = start + 1 if start else 0
            end, sent = first + len(prompt_logprobs), request.num_prompt_logprobs
            if sent > first:
                prompt_logprobs = prompt_logprobs[sent - first:] or None
            request.num_prompt_logprobs = max(sent, end)
        if not new_token_ids and prompt_logprobs is None:
            return None  # a prefill chunk with nothing to report
        return self._core_output(request, new_token_ids, logprobs, prompt_logprobs)

    def _roll_back(self, request: Request, draft: list[int], sampled: list[int]) -> None:
        """After a verify step: the rejected draft tokens' KV slots are no longer computed, and
        the blocks past the computed tokens go back to the pool (the runner drops the same)."""
        assert self.spec is not None
        num_accepted = max(0, len(sampled) - 1)
        self.spec.on_verified(request.request_id, len(draft), num_accepted)
        num_rejected = len(draft) - num_accepted
        if request.prediction is not None:  # its drafts come from its prediction alone
            request.prediction_tokens[0] += num_accepted
            request.prediction_tokens[1] += num_rejected
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            self.kv_cache_manager.trim(request, request.num_computed_tokens)

    @staticmethod
    def _core_output(
        request: Request, new_token_ids: list[int], logprobs: list[Logprobs] | None,
        prompt_logprobs: list[Logprobs | None] | None, error: str | None = None,
    ) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            num_cached_tokens=max(0, request.num_cached_tokens),
            error=error,
            prediction_tokens=(None if request.prediction is None
                               else tuple(request.prediction_tokens)),
        )

    def _fail(self, request: Request, error: str) -> EngineCoreOutput:
        """Finish a running request that failed alone this step (blocks freed)."""
        logger.warning("request %s failed: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request, had_runner_state=True)
        return self._core_output(request, [], None, None, error)

    def _free_request(self, request: Request, had_runner_state: bool) -> None:
        """Forget a finished request (the caller removes it from `running`/`waiting`)."""
        self.kv_cache_manager.free(request)
        if self.spec is not None:
            self.spec.drop(request.request_id)
        if had_runner_state or request.num_preemptions:  # (the runner may keep its generator)
            self.finished_req_ids.add(request.request_id)
        self.preempted_req_ids.discard(request.request_id)
        del self.requests[request.request_id]

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string), waiting or running; unknown or
        already finished ids are ignored."""
        if not status.is_finished():
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        stopped_running = False
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            was_running = request.status == RequestStatus.RUNNING
            if was_running:
                stopped_running = True
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request, had_runner_state=was_running)
        if stopped_running:
            self.running = [r for r in self.running if not r.is_finished()]

    # ---- introspection ---------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.prefix_cache_stats
