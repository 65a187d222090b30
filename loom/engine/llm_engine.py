"""LLMEngine: one step = schedule -> execute_model -> update_from_output -> detokenize -> emit.

A request with `n > 1` is fanned out into `n` scheduler requests with the same prompt; with
prefix caching on they share the prompt's full KV blocks by reference count.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from loom.config import CacheConfig, ConfigError, SchedulerConfig
from loom.core.kv_cache_manager import KVCacheManager, default_resident_blocks
from loom.core.outputs import EngineCoreOutput
from loom.core.scheduler import RequestRejectedError, Scheduler
from loom.engine.args import AHEAD_BUDGET_S, EngineArgs
from loom.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loom.engine.spec import drop_after_stop, spec_decoder
from loom.layers.recurrent import state_bytes
from loom.loader.model_loader import LoadedModel, load_model, resolve_dtype
from loom.loader.resolve import resolve_model
from loom.quant.int8 import DECODE_ROWS
from loom.quant.kquant import R16_INT_ROWS, KBlocks, KQuantLinear
from loom.request import FinishReason, Request, RequestStatus
from loom.sample.metadata import check_token_ids_in_vocab
from loom.sampling_params import SamplingParams, SamplingParamsError
from loom.structured.backend import CompiledGrammar, GrammarError
from loom.structured.manager import StructuredOutputManager
from loom.threads import apply_thread_defaults, set_num_threads
from loom.tokenizer.detokenizer import IncrementalDetokenizer
from loom.tokenizer.tokenizer import Tokenizer
from loom.worker.gpu_memory import profile_kv_cache_memory
from loom.worker.kv_cache import (
    KVPrefaulter, bytes_per_block, determine_num_blocks, kv_cache_dtype,
)
from loom.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# What a hybrid model's prefix caching keeps of its per-request states by default (copies at
# block boundaries, the newest used kept; --state-cache-memory): 13 of Qwen3.5-0.8B's (19 MiB
# each), and 8 requests' where one's are larger (Granite-4.0-H-1B's 56 MiB): a few
# conversations' next turns. 1 GiB had Loom's peak RSS at 1.40x llama-server's on the
# Qwen3.5-0.8B shape (docs/models.md)
STATE_CACHE_BYTES = 256 << 20
STATE_CACHE_MIN_ENTRIES = 8


def state_cache_bytes(args: EngineArgs, model) -> int:
    """What a hybrid model's prefix caching may keep of its requests' states (StateSnapshots):
    --state-cache-memory, by default STATE_CACHE_BYTES and at least STATE_CACHE_MIN_ENTRIES
    requests' states; 0 for other models, with prefix caching off, and where the budget holds
    less than one request's states (a hybrid then caches no prefix: a hit needs them)."""
    if args.state_cache_memory is not None and args.state_cache_memory < 0:
        raise ConfigError(f"state_cache_memory must be >= 0, got {args.state_cache_memory}")
    per = state_bytes(model)
    if not per or not args.enable_prefix_caching:
        return 0
    if args.state_cache_memory is not None:
        return args.state_cache_memory if args.state_cache_memory >= per else 0
    return max(STATE_CACHE_BYTES, STATE_CACHE_MIN_ENTRIES * per)


class InvalidRequestError(ValueError):
    """A request the engine cannot take; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _Child:
    index: int
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0
    touched: set[str] = field(default_factory=set)
    error: str | None = None  # set when a sample failed alone; the request then fails


@dataclass
class EngineStats:
    """Counters for /metrics; the engine only ever increases the totals."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        apply_thread_defaults()  # effective only before torch loads; else it says so, once
        set_num_threads(args.num_threads)
        device = torch.device(args.resolved_device())
        if args.seed is not None:
            torch.manual_seed(args.seed)
        source = resolve_model(args.model)
        self.model_name = args.served_model_name or source.name
        # Checked before the (slow) load: a bad name fails at once.
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype, device))
        # A tokenizer folder at hand is read before the weights: its parse peaks at hundreds of
        # MB (Gemma 3's vocabulary), handed back (loom.heap) before the weights take memory.
        tokenizer = Tokenizer.from_source(source) if Tokenizer.is_ready(source) else None
        loaded = load_model(source, args.dtype, device, progress=True,
                            quantization=args.quantization, cpu_kernels=args.cpu_kernels,
                            batch_invariant=args.batch_invariant)
        if args.kv_cache_dtype == "auto":
            self.kv_dtype = loaded.default_kv_cache_dtype() or self.kv_dtype
        self.tensor_parallel = None  # rank 0 here, the other ranks in worker processes
        hybrid = bool(loaded.config.linear_layers)  # per-request states (Qwen3.5, LFM2)
        if hybrid and (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1):
            raise ConfigError("tensor and pipeline parallelism do not run hybrid models "
                              "(layers with a state per request) yet")
        if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
            from loom.distributed.executor import TensorParallel

            self.tensor_parallel = TensorParallel.start(args, source, device, loaded)
            loaded = self.tensor_parallel.loaded  # rank 0's slices; config: one rank's heads
        self.model_config = loaded.config
        if tokenizer is None:  # a GGUF's tokenizer not converted yet: now, after the weights
            tokenizer = Tokenizer.from_source(source)
        self.tokenizer = tokenizer.set_model_eos_token_ids(loaded.config.eos_token_ids)
        if args.chat_template is not None:
            self.tokenizer.hf.chat_template = args.chat_template
        self.eos_token_ids = self.tokenizer.eos_token_ids
        max_model_len = args.max_model_len or loaded.config.max_position_embeddings
        if max_model_len > loaded.config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({max_model_len}) exceeds the model's context length "
                f"({loaded.config.max_position_embeddings})"
            )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.resolved_max_num_batched_tokens(device.type),
            max_model_len=max_model_len,
            policy=args.scheduling_policy,
        )
        kv_cache_memory = args.kv_cache_memory
        if (device.type == "cuda" and kv_cache_memory is None and self.tensor_parallel is None
                and args.num_gpu_blocks_override is None):
            kv_cache_memory = self._profile_gpu_memory(args, loaded)
        states = state_cache_bytes(args, loaded.model)
        cache_config = CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching and (not hybrid or states > 0),
            kv_cache_memory=kv_cache_memory,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
        )
        num_blocks = determine_num_blocks(
            cache_config, loaded.config, self.kv_dtype, device,
            max_needed_tokens=2 * args.max_num_seqs * max_model_len,
        )
        self._log_cache(num_blocks, cache_config, loaded, max_model_len)
        # a KV size asked for (--kv-cache-memory) is the user's to fill with prefix history;
        # the default size, half the free memory, keeps idle history within one context
        resident = (default_resident_blocks(device.type, max_model_len, cache_config.block_size)
                    if args.kv_cache_memory is None else None)
        kv_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, max_model_len,
            resident,
        )
        small = _small_step_rows(loaded) if device.type == "cpu" else 0
        if small:
            kv_manager.min_new_tokens = small + 1
        self.scheduler = Scheduler(self.scheduler_config, kv_manager, cache_config.block_size,
                                   spec_decoder(args, max_model_len, loaded.config,
                                                cache_config.block_size, device,
                                                loaded.kernels))
        steps = args.resolved_scheduler_steps(device.type)
        if steps > 1 and self.tensor_parallel is not None:
            raise ConfigError("num_scheduler_steps > 1 does not run with tensor or pipeline "
                              "parallelism")
        self.scheduler.decode_steps = steps
        if args.num_scheduler_steps is None:  # by default, within a time bound
            self.scheduler.ahead_budget_s = AHEAD_BUDGET_S
        self.runner = ModelRunner(
            loaded.model, loaded.config, self.eos_token_ids, cache_config.block_size, num_blocks,
            self.kv_dtype, device, max_num_seqs=args.max_num_seqs, state_cache_bytes=states,
        )
        if self.runner.snapshots is not None:  # a hybrid's hits end where its states were kept
            kv_manager.state_hit = self.runner.snapshots.__contains__
            self.scheduler.state_boundaries = True
        if device.type == "cuda" and not args.enforce_eager and self.tensor_parallel is None:
            self.runner.capture_cuda_graphs(args.max_num_seqs, max_model_len)
        if self.tensor_parallel is not None:  # every step runs on every rank
            self.runner = self.tensor_parallel.drive(
                self.runner, num_blocks, self.kv_dtype, self.eos_token_ids,
                cache_config.block_size)
        self.structured = StructuredOutputManager(self.tokenizer, loaded.config.vocab_size)
        self.num_blocks = num_blocks
        self.prefaulter = KVPrefaulter(self.runner.kv_caches)
        # blocks to keep faulted in ahead of the pool: two steps' worth of fresh prompt tokens,
        # at most 64 (~15 MB on the default model with the int8 cache)
        self.prefault_ahead = min(2 * -(-self.scheduler_config.max_num_batched_tokens
                                        // cache_config.block_size), 64)
        self.load_seconds = loaded.load_seconds
        self.source, self.loaded = source, loaded  # for the server's start-up line (startup.py)
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}
        self.stats = EngineStats()
        self._aborted: list[str] = []

    def prefault_kv_cache(self, max_blocks: int) -> int:
        """Fault in the host pages of up to `max_blocks` of the blocks the pool hands out next
        (KVPrefaulter), for a caller with nothing else to do; returns how many it did (0: all
        `prefault_ahead` next blocks are in already, or this device has no need)."""
        queue = self.scheduler.kv_cache_manager.block_pool.free_block_queue
        return self.prefaulter.populate(
            [b.block_id for b in queue.peek(self.prefault_ahead)], max_blocks)

    def huge_pages_step(self) -> bool:
        """Move one piece of the weights onto huge pages (loom/loader/hugepages.py), for a
        caller with nothing else to do; False once there is nothing left to move."""
        pager = self.loaded.huge_pages
        return pager is not None and pager.step()

    def _profile_gpu_memory(self, args: EngineArgs, loaded) -> int:
        """KV-cache bytes from --gpu-memory-utilization and a profiled max-size step."""
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{args.gpu_memory_utilization}")
        free = profile_kv_cache_memory(
            loaded.model, loaded.config, self.scheduler_config.max_num_batched_tokens,
            self.scheduler_config.max_num_seqs, args.block_size, self.kv_dtype, loaded.device,
            args.gpu_memory_utilization)
        # a hybrid's per-request states take their part first (one slot a running request,
        # and its prefix cache's copies)
        states = self.scheduler_config.max_num_seqs * state_bytes(loaded.model)
        states += state_cache_bytes(args, loaded.model)
        if states and free - states <= 0:
            raise ConfigError(f"the {self.scheduler_config.max_num_seqs} requests' states "
                              f"({states / 2**20:.0f} MiB) leave no memory for the KV cache: "
                              "lower --max-num-seqs or raise --gpu-memory-utilization")
        return free - states

    def _log_cache(self, num_blocks: int, cache: CacheConfig, loaded, max_model_len: int) -> None:
        tokens = (num_blocks - 1) * cache.block_size
        size = num_blocks * bytes_per_block(loaded.config, cache.block_size, self.kv_dtype)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s), %d tokens, max concurrency %.1fx at "
            "max_model_len %d", num_blocks, cache.block_size, size / 2**20,
            str(self.kv_dtype).removeprefix("torch."), tokens, tokens / max_model_len, max_model_len,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
    ) -> None:
        """Tokenize (if text), validate and queue a request. Raises InvalidRequestError.

        `prompt_token_ids`: a text prompt's ids, tokenized by the caller already (the server
        does it off the engine thread). `priority`: its rank under `--scheduling-policy
        priority` (lower first); any other value than 0 is refused under "fcfs", as vLLM does."""
        if request_id in self.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self._check_priority(priority)
        if isinstance(prompt, str):
            text: str | None = prompt
            prompt_ids = (self.tokenizer.encode(prompt) if prompt_token_ids is None
                          else list(prompt_token_ids))
        else:
            text, prompt_ids = None, _token_ids(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # -1: the most that leaves room for max_tokens
            max_len = self.scheduler_config.max_model_len
            keep = keep if keep > 0 else max(1, max_len - (params.max_tokens or 1))
            if len(prompt_ids) > keep:
                text, prompt_ids = None, prompt_ids[-keep:]
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(bad_words_token_ids=self._bad_words_ids(params.bad_words))
        self._validate(prompt_ids, params)
        prediction = self._prediction(params)
        grammar = self.compile_grammar(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children: dict[str, _Child] = {}
        requests = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1:  # distinct but reproducible streams per sample
                seed = None if params.seed is None else params.seed + i
                child_params = params.clone(n=1, seed=seed)
            request = Request(child_id, prompt_ids, child_params, self.eos_token_ids, arrival,
                              priority=priority)
            if grammar is not None:
                request.grammar = grammar.matcher()
            request.prediction = prediction
            requests.append(request)
            detok = IncrementalDetokenizer(self.tokenizer.backend, prompt_ids, child_params)
            out = CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
            children[child_id] = _Child(i, detok, out)
        try:
            for req in requests:
                self.scheduler.add_request(req)
        except RequestRejectedError as e:
            self.scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
            raise InvalidRequestError(str(e), param="max_tokens") from None
        self.parents[request_id] = _ParentState(
            request_id, text, prompt_ids, params, children, RequestMetrics(arrival)
        )
        for child_id in children:
            self.child_to_parent[child_id] = request_id
        self.stats.prompt_tokens_total += len(prompt_ids)

    def _check_priority(self, priority: object) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}",
                                      param="priority")
        if priority and self.scheduler_config.policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs the priority scheduling policy (this engine "
                "schedules first come, first served: --scheduling-policy priority)",
                param="priority")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as written at the start of a text and, where that makes other
        tokens of the same number (a new first token), after a space, as vLLM does."""
        out: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if bare:
                out.append(bare)
            if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
                out.append(spaced)
        return out

    def _prediction(self, params: SamplingParams) -> np.ndarray | None:
        """The request's prediction as token ids (text tokenized without special tokens, as
        the output would hold it), at most max_model_len of them; None without one or where
        nothing proposes drafts from it (tensor or pipeline parallelism)."""
        pred = params.prediction
        if pred is None or self.scheduler.spec is None:
            return None
        ids = self.tokenizer.encode(pred, add_special_tokens=False) if isinstance(pred, str) \
            else pred
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"prediction token ids out of range [0, {vocab}): "
                                      f"{bad[:5]}", "prediction")
        return np.asarray(ids[: self.scheduler_config.max_model_len], dtype=np.int64) \
            if ids else None

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
        max_len = self.scheduler_config.max_model_len
        if len(prompt_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; max_model_len is {max_len}, which must "
                "leave room for at least one generated token", param="prompt",
            )
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({max_len})", param="max_tokens",
            )
        try:
            check_token_ids_in_vocab(params, vocab)
        except SamplingParamsError as e:
            raise InvalidRequestError(str(e), param=e.param) from None

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled output constraint (cached), or None if it has none.

        Thread-safe: the server calls it off the engine thread first, so the engine thread only
        finds it cached. Raises InvalidRequestError for an invalid schema, regex or grammar.
        """
        if params.structured_outputs is None:
            return None
        try:
            return self.structured.compile(params.structured_outputs)
        except GrammarError as e:
            raise InvalidRequestError(str(e), param="structured_outputs") from None

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now; their blocks are freed and a final output says "abort"."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is None:
                continue
            self._finish_live(parent, "abort")
            self._aborted.append(request_id)

    def _finish_live(self, parent: _ParentState, finish_reason: str) -> None:
        """Stop a request's unfinished samples now with `finish_reason` (blocks freed)."""
        live = [c for c, child in parent.children.items() if not child.output.finished]
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for child_id in live:
            parent.children[child_id].output.finish_reason = finish_reason
            parent.num_finished += 1
            parent.touched.add(child_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one model step; return an output for every request that changed."""
        touched = self._take_aborted()
        start = time.perf_counter()
        sched_output = self.scheduler.schedule()
        if not sched_output.is_empty:
            failed: dict[str, str] = {}  # requests whose grammar failed: they fail alone
            grammar = self.structured.grammar_bitmask(sched_output, self.scheduler.requests,
                                                      failed)
            if grammar is not None:
                sched_output.grammar_bitmask, sched_output.structured_rows = grammar
            now = time.monotonic()
            for new in sched_output.scheduled_new_reqs:
                parent = self.parents.get(self.child_to_parent.get(new.req_id, ""))
                if parent is not None and parent.metrics.first_scheduled_time is None:
                    parent.metrics.first_scheduled_time = now
            runner_output = self.runner.execute_model(sched_output)
            runner_output.failed.update(failed)
            for out in self.scheduler.update_from_output(sched_output, runner_output):
                parent_id = self._process_contained(out)
                if parent_id is not None and parent_id not in touched:
                    touched.append(parent_id)
            seconds = time.perf_counter() - start
            if self.scheduler.spec is not None:  # the adaptive draft length's step costs
                self.scheduler.spec.observe_step(sched_output, seconds)
            self.scheduler.observe_step(sched_output, seconds)  # steps ahead's time bound
        return [self._emit(pid) for pid in touched if pid in self.parents]

    def _take_aborted(self) -> list[str]:
        aborted, self._aborted = list(dict.fromkeys(self._aborted)), []
        return aborted

    def _process_contained(self, out: EngineCoreOutput) -> str | None:
        """`_process`, but a request whose output cannot be processed (detokenizing, stop
        strings) fails alone with an error instead of failing the step."""
        try:
            return self._process(out)
        except Exception as e:  # noqa: BLE001 - this request's error alone
            logger.exception("processing the output of %s failed", out.req_id)
            self.scheduler.finish_requests([out.req_id], RequestStatus.FINISHED_ERROR)
            error = f"internal error while processing the output: {type(e).__name__}: {e}"
            failed = EngineCoreOutput(out.req_id, [], finish_reason=FinishReason.ERROR,
                                      error=error[:300])
            return self._process(failed)

    def _fail_parent(self, parent: _ParentState, error: str) -> None:
        """One sample failed: the whole request fails with its error (siblings aborted)."""
        parent.error = parent.error or error
        self._finish_live(parent, "error")

    def _process(self, out: EngineCoreOutput) -> str | None:
        parent_id = self.child_to_parent.get(out.req_id)
        if parent_id is None:
            return None
        parent = self.parents[parent_id]
        child = parent.children[out.req_id]
        if out.error is not None:
            if not child.output.finished:
                child.output.finish_reason = "error"
                parent.num_finished += 1
            self._fail_parent(parent, out.error)
            return parent_id
        now = time.monotonic()
        if out.new_prompt_logprobs is not None and child.index == 0:
            if parent.prompt_logprobs is None:  # tokens 0..cached have none (a prefix-cache hit
                cached = out.num_cached_tokens   # under prompt_logprobs_start)
                parent.prompt_logprobs = [None] * (cached + 1) if cached else []
            parent.prompt_logprobs = parent.prompt_logprobs + out.new_prompt_logprobs
        if out.new_token_ids:
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            self.stats.generation_tokens_total += len(out.new_token_ids)
        o = child.output
        o.token_ids.extend(out.new_token_ids)
        o.delta_token_ids.extend(out.new_token_ids)
        if o.logprobs is not None and out.new_logprobs is not None:
            o.logprobs.extend(out.new_logprobs)
            o.delta_logprobs.extend(out.new_logprobs)
        if out.prediction_tokens is not None:
            o.accepted_prediction_tokens, o.rejected_prediction_tokens = out.prediction_tokens
        finish, stop_reason = out.finish_reason, out.stop_reason
        # The token that stopped the request (EOS, a stop_token_ids entry) adds no text unless
        # include_stop_str_in_output (vLLM's rule; visible with skip_special_tokens=False)
        text_ids = out.new_token_ids
        if text_ids and self._stopped_by_token(parent.params, finish, stop_reason, text_ids[-1]):
            text_ids = text_ids[:-1]
        stop_str = child.detokenizer.update(text_ids) if text_ids else None
        # A step of several tokens (accepted drafts, steps ahead) may have ended by its last
        # token's rule (max_tokens, a stop token) after a stop string completed at an earlier
        # one: the string came first, as one token a step would have found it.
        if stop_str is not None and (finish is None or
                                     len(child.detokenizer.output_token_ids) < len(o.token_ids)):
            drop_after_stop(o, len(child.detokenizer.output_token_ids))
            if finish is None:
                self.scheduler.finish_requests([out.req_id], RequestStatus.FINISHED_STOPPED)
            finish, stop_reason = "stop", stop_str
        if finish is not None:
            o.finish_reason, o.stop_reason = str(finish), stop_reason
            parent.num_finished += 1
        parent.touched.add(out.req_id)
        return parent_id

    def _stopped_by_token(self, params: SamplingParams, finish: object, stop_reason: object,
                          last: int) -> bool:
        """Whether `last` ended the request as a stop token whose text stays out."""
        if finish != FinishReason.STOP or params.include_stop_str_in_output:
            return False
        if isinstance(stop_reason, int):  # a stop_token_ids entry (check_stop's stop_reason)
            return True
        # EOS (a completed structured output also stops with no reason, on its last real token)
        return stop_reason is None and not params.ignore_eos and last in self.eos_token_ids

    def _emit(self, parent_id: str) -> RequestOutput:
        parent = self.parents[parent_id]
        for child_id in parent.touched:
            child = parent.children[child_id]
            o = child.output
            o.delta_text = child.detokenizer.get_next_output_text(o.finished, delta=True)
            o.text += o.delta_text
        parent.touched.clear()
        finished = parent.num_finished == len(parent.children)
        outputs = [c.output for c in parent.children.values()]
        result = RequestOutput(
            request_id=parent_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[_snapshot(o) for o in outputs],
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
            error=parent.error,
            embedding=self.runner.pooler.pooled.pop(parent_id, None) if finished else None,
        )
        for o in outputs:  # deltas are reported once
            o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], []
        if finished:
            parent.metrics.finished_time = time.monotonic()
            del self.parents[parent_id]
            for child_id in parent.children:
                self.child_to_parent.pop(child_id, None)
        return result

    def check_integrity(self) -> None:
        self.scheduler.kv_cache_manager.check_integrity()


def _small_step_rows(loaded: LoadedModel) -> int:
    """The most rows a step runs on CPU kernels whose bits differ from a longer step's (the
    decode kernels: 8 rows; interleaved Q4_K's integer kernel: 32), 0 where none do."""
    kernels = loaded.kernels
    if kernels is None or kernels.same_bits_past_8:
        return 0
    interleaved = any(isinstance(p, KBlocks) and p.interleaved
                      for m in loaded.model.modules() if isinstance(m, KQuantLinear)
                      for _, p in m.parts.values())
    return R16_INT_ROWS if interleaved else DECODE_ROWS


def _token_ids(prompt: object) -> list[int]:
    """A token-id prompt as a list of ints (numpy and torch integers too); anything else is a
    clear InvalidRequestError, not a TypeError from deep in validation."""
    try:
        return [operator.index(t) for t in prompt]  # type: ignore[union-attr]
    except TypeError:
        message = (f"a prompt is a string or a list of token ids, not {type(prompt).__name__}"
                   if not isinstance(prompt, (list, tuple)) else "prompt token ids must be integers")
        raise InvalidRequestError(message, param="prompt") from None


def _snapshot(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        index=o.index, text=o.text, token_ids=list(o.token_ids),
        logprobs=None if o.logprobs is None else list(o.logprobs),
        finish_reason=o.finish_reason, stop_reason=o.stop_reason, delta_text=o.delta_text,
        delta_token_ids=o.delta_token_ids, delta_logprobs=o.delta_logprobs,
        accepted_prediction_tokens=o.accepted_prediction_tokens,
        rejected_prediction_tokens=o.rejected_prediction_tokens,
    )
