"""The model runner owns every tensor: per-request state, the KV cache, the forward pass and
sampling. It turns a plain-data `SchedulerOutput` into a `ModelRunnerOutput`."""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from loom.attention.backends import triton_attn
from loom.attention.backends.triton_attn import bind_fp8_kv_scales
from loom.attention.forward_context import set_forward_context
from loom.attention.metadata import (
    AttentionMetadata, Workspace, build_attention_metadata, next_decode_metadata, to_device,
)
from loom.config import ModelConfig
from loom.core.sched_output import (
    Logprobs, ModelRunnerOutput, NewRequestData, SchedulerOutput,
)
from loom.layers.recurrent import StateSnapshots
from loom.sample.metadata import SamplingMetadata
from loom.sample.penalties import apply_all
from loom.sample.rejection import normalise_
from loom.sample.sampler import Sampler, compute_prompt_logprobs
from loom.sampling_params import SamplingParams
from loom.structured.backend import apply_token_bitmask
from loom.worker.cuda_graph import DecodeGraphs
from loom.worker.kv_cache import allocate_kv_caches
from loom.worker.pooler import Pooler
from loom.worker.spec_verify import verify_draft

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every generated token known to the runner
    prompt_token_ids: list[int]  # kept apart so the sampler reads it without a per-step copy
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    state_slot: int = -1  # its states' slot in a hybrid model's linear layers (-1: none)
    # a hybrid's kept states (StateSnapshots): the key of those at its prompt's last boundary
    # before its last token, and of the newest past it, the one of those it keeps
    prompt_key: object = None
    reply_key: object = None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        eos_token_ids: tuple[int, ...],
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int = 256,
        state_cache_bytes: int = 0,
    ) -> None:
        """`max_num_seqs`: the most requests running at once (the scheduler's bound), the
        state slots a hybrid model's linear layers get; `state_cache_bytes`: what its prefix
        caching may keep of their states at block boundaries (0: none)."""
        self.model = model
        self.model_config = model_config
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_caches(model_config, num_blocks, block_size, dtype, device)
        for attn, cache in zip(model.attention_layers(), self.kv_caches):  # type: ignore[operator]
            attn.kv_cache = cache
        if dtype == torch.float8_e4m3fn:  # the Triton kernels' FP8 cache (CUDA)
            bind_fp8_kv_scales(model.attention_layers(), device)  # type: ignore[operator]
        self.sampler = Sampler()
        self.workspace = Workspace()
        self.requests: dict[str, CachedRequestState] = {}
        # A preempted seeded request's generator until it resumes (its draws go on from there).
        self.resumed_generators: dict[str, torch.Generator] = {}
        self.pooler = Pooler()  # embedding requests' pooled hidden states
        self.graphs: DecodeGraphs | None = None  # CUDA only: capture_cuda_graphs
        # A hybrid model's layers with a state per request, and the free slots (a heap: the
        # lowest first, so the slots in use stay few and their host pages stay the same).
        self.state_layers = model.recurrent_layers() if hasattr(model, "recurrent_layers") \
            else []
        self.free_slots = list(range(max_num_seqs)) if self.state_layers else []
        if self.state_layers:
            total = sum(layer.allocate_states(max_num_seqs, device)
                        for layer in self.state_layers)
            logger.info("%d state slots of %.1f MiB (the layers with a state per request; "
                        "host memory committed as slots are first used)", max_num_seqs,
                        total / max_num_seqs / 2**20)
        # A draft model's runner: req_id -> the distribution each sampled row was drawn from
        # (_sample_keeping); None: sample as the target does
        self.kept_probs: dict[str, list[torch.Tensor]] | None = None
        self.snapshots = (StateSnapshots(self.state_layers, state_cache_bytes)
                          if self.state_layers and state_cache_bytes else None)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Decode steps replay CUDA graphs (loom/worker/cuda_graph.py) from now on, where every
        attention layer runs the Triton kernels; a model whose capture fails stays eager (said
        in the log). Returns whether graphs run."""
        layers = self.model.attention_layers()  # type: ignore[operator]
        if self.state_layers:
            logger.warning("CUDA graphs do not run a hybrid model's layers with a state per "
                           "request; decode steps run eagerly")
            return False
        if not triton_attn.available():
            logger.warning("CUDA graphs need the Triton attention kernels (pip install triton); "
                           "decode steps run eagerly")
            return False
        graphs = DecodeGraphs(self.model, max_num_seqs, max_model_len, self.block_size,
                              self.model_config.num_key_value_heads, self.device)
        try:
            with torch.inference_mode():
                graphs.capture()
        except Exception:  # noqa: BLE001 - eager decode still runs; the reason goes to the log
            logger.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
            return False
        if not all(attn.use_triton for attn in layers):
            logger.warning("CUDA graphs need the Triton attention kernels; decode runs eagerly")
            return False
        self.graphs = graphs
        return True

    def _update_states(self, so: SchedulerOutput, failed: dict[str, str]) -> None:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            self.pooler.drop(req_id)
            gen = None if state is None else state.generator
            if state is not None and state.state_slot >= 0:
                heapq.heappush(self.free_slots, state.state_slot)
            if gen is not None and req_id in so.preempted_req_ids:
                self.resumed_generators[req_id] = gen
            else:
                self.resumed_generators.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            try:  # a request whose inputs cannot be prepared fails alone (`failed`)
                self.requests[new.req_id] = self._new_state(new)
            except Exception as e:  # noqa: BLE001 - reported as this request's error
                _fail_alone(failed, new.req_id, "preparing the request", e)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.block_ids.extend(block_ids)
            state.num_computed_tokens = num_computed

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        """The runner's state of a newly scheduled request; raises if its sampling inputs
        cannot be built (checked here, on its own row, so it never fails a batch)."""
        params = new.sampling_params
        gen = self.resumed_generators.pop(new.req_id, None)  # resumed after a preemption
        if new.generator is not None:
            gen = new.generator
        elif params.seed is not None and gen is None:
            gen = torch.Generator(device=self.device)
            # Any integer seeds: torch takes [0, 2**64) (a negative one as its two's complement).
            gen.manual_seed(params.seed & _SEED_MASK)
        prompt = list(new.token_ids[: new.num_prompt_tokens])
        output = list(new.token_ids[new.num_prompt_tokens :])
        SamplingMetadata.build([params], [prompt], [output], [gen], self.eos_token_ids,
                               self.model_config.vocab_size, self.device)
        slot = -1
        if self.state_layers:
            if not self.free_slots:
                raise RuntimeError("more running requests than max_num_seqs state slots")
            if new.num_computed_tokens and (self.snapshots is None
                                            or new.state_key not in self.snapshots):
                raise RuntimeError("a prefix hit without its states")
            slot = heapq.heappop(self.free_slots)
            if new.num_computed_tokens:
                self.snapshots.restore(new.state_key, slot)  # type: ignore[union-attr]
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            prompt_token_ids=prompt,
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=gen,
            output_token_ids=output,
            state_slot=slot,
        )

    @torch.inference_mode()
    def _keep_states(self, keys: dict[str, object], states: list[CachedRequestState],
                     computed: list[int], num_sched: list[int], skip: dict) -> None:
        """Each request's states where its step ended on a block boundary (`keys`; requests in
        `skip`, a verify step's drafting ones, keep theirs as they commit)."""
        for s, c, n in zip(states, computed, num_sched):
            key = keys.get(s.req_id)
            if key is not None and s.req_id not in skip:
                self._save_state(s, key, c + n)

    def _save_state(self, s: CachedRequestState, key: object, end: int) -> None:
        """Request s's states now, those after its first `end` tokens, for later prefix hits.
        Up to its prompt's last boundary before its last token (the furthest the same prompt
        again can hit) every boundary a step ends on is kept; past it only the newest (a next
        turn's prompt holds the whole reply; the older ones of a long reply would fill the
        budget and push out other requests'), and once there is one, the prompt's goes first
        when room is needed (a next turn hits the reply's)."""
        snapshots = self.snapshots
        assert snapshots is not None
        if end <= (s.num_prompt_tokens - 1) // self.block_size * self.block_size:
            snapshots.save(key, s.state_slot)
            s.prompt_key = key
            return
        if s.reply_key is not None and s.reply_key != key:
            snapshots.drop(s.reply_key)  # (first: its room is the new one's)
        elif s.reply_key is None and s.prompt_key is not None:
            snapshots.demote(s.prompt_key)
        snapshots.save(key, s.state_slot)
        s.reply_key = key

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One forward and sampling step. A request whose own inputs fail (preparing, sampling,
        prompt logprobs) is reported in `failed` and the others go on; an exception raised
        here (the forward itself) concerns the whole batch."""
        failed: dict[str, str] = {}
        self._update_states(so, failed)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed=failed)
        req_ids = [r for r in so.num_scheduled_tokens if r not in failed]
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed=failed)
        states = [self.requests[r] for r in req_ids]
        num_sched = [so.num_scheduled_tokens[r] for r in req_ids]
        computed = [s.num_computed_tokens for s in states]
        drafts = so.scheduled_spec_decode_tokens  # speculative drafts, after each last token
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                s.token_ids[c : c + n] if s.req_id not in drafts
                else s.token_ids[c : c + 1] + drafts[s.req_id]
                for s, c, n in zip(states, computed, num_sched)
            ),
            dtype=np.int64, count=sum(num_sched),
        )
        md, positions = build_attention_metadata(
            [s.block_ids for s in states], computed, num_sched, self.block_size, self.device,
            self.workspace,
        )
        if self.state_layers:
            md.state_slots = np.fromiter((s.state_slot for s in states), dtype=np.int64,
                                         count=len(states))
            if drafts:  # a verify step: the drafting requests' states move once verified
                md.state_dry = np.fromiter((s.req_id in drafts for s in states), dtype=np.int8,
                                           count=len(states))
        ends = np.cumsum(num_sched)
        # A request samples when this step reaches the end of its known tokens.
        sampling = [i for i, (s, c, n) in enumerate(zip(states, computed, num_sched))
                    if c + n - len(drafts.get(s.req_id, ())) == len(s.token_ids)]
        rows = ends[sampling] - 1
        if drafts:  # a draft's rows all get logits: row i scores draft token i
            rows, sampling, spec = _draft_rows(req_ids, sampling, ends, drafts)
        # Past the last layer's attention only the sampling rows matter, unless a prompt's
        # logprobs need every row's hidden state.
        all_rows = any(s.sampling_params.prompt_logprobs is not None
                       and c < s.num_prompt_tokens for s, c in zip(states, computed)
                       ) or self.pooler.needs_all_rows(states, computed)
        ids_t, pos_t = to_device(input_ids, self.device), to_device(positions, self.device)
        if (self.graphs is not None and not drafts and not all_rows
                and len(rows) == md.num_tokens and self.graphs.can_run(len(req_ids), md)):
            hidden, logits = self.graphs.run(ids_t, pos_t, md)  # a decode-only step
        else:
            with set_forward_context(md):
                hidden, logits = self.model.forward_logits(  # [num_tokens, h], [sampling, V]
                    ids_t, pos_t, rows, only_rows=not all_rows)
        self.pooler.step(states, computed, num_sched, ends, hidden, None if all_rows else rows)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list[Logprobs] | None] = [None] * len(req_ids)
        if drafts:
            logits = self._verify(logits, states, spec, so, sampled_lists, logprobs, failed)
            if md.state_dry is not None:
                self._commit_states(so, states, computed, num_sched, md.state_dry,
                                    sampled_lists)
        if so.state_keys and self.snapshots is not None:  # states at a block boundary
            self._keep_states(so.state_keys, states, computed, num_sched, drafts)
        if sampling:
            if so.grammar_bitmask is not None:
                self._apply_grammar(logits, [req_ids[i] for i in sampling], so)
            sampled_states = [states[i] for i in sampling]
            for j, (token, lp) in enumerate(self._sample(logits, sampled_states, failed)):
                i = sampling[j]
                if token is None:
                    continue
                states[i].token_ids.append(token)
                states[i].output_token_ids.append(token)
                sampled_lists[i] = [token]
                logprobs[i] = None if lp is None else [lp]
        # after sampling: an int8 head writes every call's logits into the buffer it reuses
        prompt_lps = self._prompt_logprobs(states, computed, num_sched, ends, hidden, failed)
        if so.lookahead and not failed:
            self._decode_ahead(so.lookahead, states, md, positions, sampled_lists)
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs, prompt_lps, failed)

    @torch.inference_mode()
    def _commit_states(self, so: SchedulerOutput, states: list[CachedRequestState],
                       computed: list[int], num_sched: list[int], dry: np.ndarray,
                       sampled_lists: list[list[int]]) -> None:
        """A hybrid's verify step ran its drafting requests' rows on copies of their states:
        each now runs its last real token and the drafts it kept (a row per emitted token;
        the last emitted one is the next step's input) on its states, in every mixer. Where
        the kept rows pass the block boundary the scheduler named (state_keys: the last one
        in the step), the states there are kept on the way."""
        index = np.flatnonzero(dry)
        kept = np.array([max(1, len(sampled_lists[i])) for i in index], dtype=np.int64)
        upto, saves = kept.copy(), []
        for n, i in enumerate(index):
            s = states[i]
            key = None if self.snapshots is None else so.state_keys.get(s.req_id)
            rows = (computed[i] + num_sched[i]) // self.block_size * self.block_size - computed[i]
            if key is not None and 0 < rows <= kept[n]:
                upto[n] = rows
                saves.append((s, key, computed[i] + rows))
        self._commit(np.zeros_like(kept), upto)
        for s, key, end in saves:
            self._save_state(s, key, end)
        self._commit(upto, kept)

    def _commit(self, lo: np.ndarray, hi: np.ndarray) -> None:
        if (hi > lo).any():
            for layer in self.state_layers:
                layer.commit(lo, hi)

    def _decode_ahead(self, steps: int, states: list[CachedRequestState], md: AttentionMetadata,
                      positions: np.ndarray, sampled_lists: list[list[int]]) -> None:
        """The scheduler's lookahead (SchedulerOutput.lookahead): `steps` more decode steps of
        the requests of the decode-only step just run (`md`, `positions`), each token the argmax
        of the last step's logits, with no return to the scheduler (the slots are allocated).
        Stops early once every request has sampled a stop token (the scheduler drops what
        follows one)."""
        n = len(states)
        rows = np.arange(n, dtype=np.int64)
        stopped = [self._stops(s, sampled_lists[i][-1]) for i, s in enumerate(states)]
        for _ in range(steps):
            if all(stopped):
                return
            positions = positions + 1
            input_ids = np.fromiter((s.token_ids[-1] for s in states), dtype=np.int64, count=n)
            md = next_decode_metadata(md, positions)
            with set_forward_context(md):
                _, logits = self.model.forward_logits(
                    to_device(input_ids, self.device), md.positions, rows, only_rows=True)
            for i, token in enumerate(self.sampler.argmax_tokens(logits)):
                s = states[i]
                s.token_ids.append(token)
                s.output_token_ids.append(token)
                sampled_lists[i].append(token)
                stopped[i] = stopped[i] or self._stops(s, token)

    def _stops(self, state: CachedRequestState, token: int) -> bool:
        """Whether `token` ends the request (a stop token id, or EOS unless ignored)."""
        params = state.sampling_params
        return token in params.stop_token_ids or (not params.ignore_eos
                                                  and token in self.eos_token_ids)

    def _verify(self, logits: torch.Tensor, states: list[CachedRequestState],
                spec: dict[int, tuple[int, int]], so: SchedulerOutput,
                sampled_lists: list[list[int]], logprobs: list[list[Logprobs] | None],
                failed: dict[str, str]) -> torch.Tensor:
        """Verify each draft on its rows of `logits` (spec: request index -> (first row,
        rows)); returns the other sampling requests' rows. The blocks past the tokens now
        computed go, as the scheduler frees them."""
        masks = so.structured_rows or {}  # req_id -> its first row of so.grammar_bitmask
        for i, (start, num) in spec.items():
            s = states[i]
            row = masks.get(s.req_id)
            bitmask = None if row is None else so.grammar_bitmask[row : row + num]
            try:
                tokens, logprobs[i] = verify_draft(
                    logits[start : start + num], s, so.scheduled_spec_decode_tokens[s.req_id],
                    self.eos_token_ids, self.model_config.vocab_size, bitmask,
                    so.spec_decode_probs.get(s.req_id))
            except Exception as e:  # noqa: BLE001 - this request's error alone
                _fail_alone(failed, s.req_id, "verifying a speculative draft", e)
                continue
            s.token_ids.extend(tokens)
            s.output_token_ids.extend(tokens)
            sampled_lists[i] = tokens
            num_blocks = -(-(s.num_computed_tokens + len(tokens)) // self.block_size)
            del s.block_ids[num_blocks:]  # the blocks of rejected tokens
        plain = np.ones(logits.size(0), dtype=bool)  # the rows of requests without a draft
        for start, num in spec.values():
            plain[start : start + num] = False
        return logits[torch.from_numpy(plain).to(logits.device)]

    def _sample(
        self, logits: torch.Tensor, states: list[CachedRequestState], failed: dict[str, str]
    ) -> list[tuple[int | None, Logprobs | None]]:
        """(token, logprobs) per row of `logits`; (None, None) for a row that failed alone.

        The batch is sampled at once; only if that raises is each row sampled on its own
        (greedy and seeded rows give the tokens they would have given in the batch) to find
        the request that failed."""
        if all(s.sampling_params.argmax_only for s in states):
            return [(token, None) for token in self.sampler.argmax_tokens(logits)]
        if self.kept_probs is not None:
            return self._sample_keeping(logits, states)
        try:
            out = self.sampler.forward(logits, self._metadata(states))
            return list(zip(out.sampled_token_ids.tolist(), out.logprobs))
        except Exception:  # noqa: BLE001 - find the row at fault below
            # said, with its traceback: were every row to pass alone, the bug is the batch's
            logger.warning("sampling %d rows at once failed; sampling them one by one",
                           len(states), exc_info=True)
        rows: list[tuple[int | None, Logprobs | None]] = []
        for j, state in enumerate(states):
            try:
                out = self.sampler.forward(logits[j : j + 1], self._metadata([state]))
                rows.append((out.sampled_token_ids.tolist()[0], out.logprobs[0]))
            except Exception as e:  # noqa: BLE001 - this request's error alone
                _fail_alone(failed, state.req_id, "sampling", e)
                rows.append((None, None))
        return rows

    def _sample_keeping(self, logits: torch.Tensor, states: list[CachedRequestState]
                        ) -> list[tuple[int | None, Logprobs | None]]:
        """A draft model's rows (`kept_probs` on): each random row drawn from its distribution
        (the sampler's, normalised), which is kept (kept_probs[req_id], one a step) for the
        target's rejection sampling; greedy rows take the argmax. No logprobs."""
        md = self._metadata(states)
        logits = logits.to(torch.float32, copy=True)  # [rows, vocab]
        apply_all(logits, md)
        tokens, probs = self.sampler.sample_keeping(logits, md)
        if probs is not None:  # the random rows' distributions, normalised (the greedy rows' not)
            random = [j for j, s in enumerate(states) if not s.sampling_params.greedy]
            kept = self.kept_probs
            assert kept is not None
            for j, row in zip(random, normalise_(probs[random])):
                kept.setdefault(states[j].req_id, []).append(row)
        return [(token, None) for token in tokens.tolist()]

    def _metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            self.eos_token_ids,
            self.model_config.vocab_size,
            self.device,
        )

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, sampling_ids: list[str], so: SchedulerOutput) -> None:
        """Ban the tokens each constrained row's grammar forbids; other rows are untouched."""
        assert so.grammar_bitmask is not None and so.structured_rows is not None
        rows, mask_rows = [], []
        for j, req_id in enumerate(sampling_ids):
            row = so.structured_rows.get(req_id)
            if row is not None:
                rows.append(j)
                mask_rows.append(row)
        apply_token_bitmask(logits, rows, so.grammar_bitmask[mask_rows])

    def _prompt_logprobs(
        self,
        states: list[CachedRequestState],
        computed: list[int],
        num_sched: list[int],
        ends: np.ndarray,
        hidden: torch.Tensor,
        failed: dict[str, str],
    ) -> list[list[Logprobs | None] | None]:
        """Logprobs of each prompt token given its prefix, for positions computed this step.

        Position p predicts token p + 1; the first prompt token has no logprob (None)."""
        result: list[list[Logprobs | None] | None] = []
        for s, c, n, end in zip(states, computed, num_sched, ends):
            num_top = s.sampling_params.prompt_logprobs
            if num_top is None or c >= s.num_prompt_tokens:
                result.append(None)
                continue
            last = min(c + n, s.num_prompt_tokens - 1)  # positions c .. last-1 predict a prompt token
            entries: list[Logprobs | None] = [None] if c == 0 else []
            if last > c:
                start = int(end) - n
                try:
                    logits = self.model.compute_logits(hidden[start : start + last - c])
                    targets = torch.tensor(s.token_ids[c + 1 : last + 1], device=self.device)
                    entries.extend(compute_prompt_logprobs(logits, targets, num_top))
                except Exception as e:  # noqa: BLE001 - this request's error alone
                    _fail_alone(failed, s.req_id, "computing prompt logprobs", e)
            result.append(entries)
        return result


# Seeds are reduced to the 64 bits a torch generator holds.
_SEED_MASK = 2**64 - 1


def _draft_rows(
    req_ids: list[str], sampling: list[int], ends: np.ndarray, drafts: dict[str, list[int]]
) -> tuple[np.ndarray, list[int], dict[int, tuple[int, int]]]:
    """The logits rows of a step with drafts: every sampling request's last row, and all
    1 + k rows of a request with a draft of k. Returns (rows, the sampling requests without a
    draft, request index -> (its first row in the logits, its number of rows))."""
    rows: list[int] = []
    plain: list[int] = []
    spec: dict[int, tuple[int, int]] = {}
    for i in sampling:
        k = len(drafts.get(req_ids[i], ()))
        if k:
            spec[i] = (len(rows), k + 1)
        else:
            plain.append(i)
        rows.extend(range(int(ends[i]) - 1 - k, int(ends[i])))
    return np.asarray(rows, dtype=np.int64), plain, spec


def _fail_alone(failed: dict[str, str], req_id: str, what: str, e: BaseException) -> None:
    """Fail one request of the step: its client gets a short reason (no traceback, bounded
    length) in `failed`; the log gets the traceback."""
    logger.warning("request %s failed alone while %s", req_id, what, exc_info=e)
    failed[req_id] = f"internal error while {what}: {type(e).__name__}: {str(e)[:200]}"
