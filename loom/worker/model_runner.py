"""The model runner owns every tensor: per-request state, the KV cache, the forward pass and
sampling. It turns a plain-data `SchedulerOutput` into a `ModelRunnerOutput`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from loom.attention.forward_context import set_forward_context
from loom.attention.metadata import Workspace, build_attention_metadata
from loom.config import ModelConfig
from loom.core.sched_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from loom.sample.metadata import SamplingMetadata
from loom.sample.sampler import Sampler, compute_prompt_logprobs
from loom.sampling_params import SamplingParams
from loom.structured.backend import apply_token_bitmask
from loom.worker.kv_cache import allocate_kv_caches
from loom.worker.pooler import Pooler


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
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_caches(model_config, num_blocks, block_size, dtype, device)
        for attn, cache in zip(model.attention_layers(), self.kv_caches):  # type: ignore[operator]
            attn.kv_cache = cache
        self.sampler = Sampler()
        self.workspace = Workspace()
        self.requests: dict[str, CachedRequestState] = {}
        self.pooler = Pooler()  # embedding requests' pooled hidden states

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.pooler.drop(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                prompt_token_ids=list(new.token_ids[: new.num_prompt_tokens]),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=gen,
                output_token_ids=list(new.token_ids[new.num_prompt_tokens :]),
            )
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.block_ids.extend(block_ids)
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_sched = [so.num_scheduled_tokens[r] for r in req_ids]
        computed = [s.num_computed_tokens for s in states]
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                s.token_ids[c : c + n] for s, c, n in zip(states, computed, num_sched)
            ),
            dtype=np.int64, count=so.total_num_scheduled_tokens,
        )
        md, positions = build_attention_metadata(
            [s.block_ids for s in states], computed, num_sched, self.block_size, self.device,
            self.workspace,
        )
        ends = np.cumsum(num_sched)
        # A request samples when this step reaches the end of its known tokens.
        sampling = [i for i, (s, c, n) in enumerate(zip(states, computed, num_sched))
                    if c + n == len(s.token_ids)]
        # Past the last layer's attention only the sampling rows matter, unless a prompt's
        # logprobs need every row's hidden state.
        all_rows = any(s.sampling_params.prompt_logprobs is not None
                       and c < s.num_prompt_tokens for s, c in zip(states, computed)
                       ) or self.pooler.needs_all_rows(states, computed)
        with set_forward_context(md):
            hidden, logits = self.model.forward_logits(  # [num_tokens, hidden], [sampling, vocab]
                torch.from_numpy(input_ids).to(self.device),
                torch.from_numpy(positions).to(self.device),
                ends[sampling] - 1,
                only_rows=not all_rows,
            )
        self.pooler.step(states, computed, num_sched, ends, sampling, hidden, all_rows)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[Logprobs | None] = [None] * len(req_ids)
        if sampling:
            if so.grammar_bitmask is not None:
                self._apply_grammar(logits, [req_ids[i] for i in sampling], so)
            sampled_states = [states[i] for i in sampling]
            meta = SamplingMetadata.build(
                [s.sampling_params for s in sampled_states],
                [s.prompt_token_ids for s in sampled_states],
                [s.output_token_ids for s in sampled_states],
                [s.generator for s in sampled_states],
                self.eos_token_ids,
                self.model_config.vocab_size,
                self.device,
            )
            out = self.sampler.forward(logits, meta)
            tokens = out.sampled_token_ids.tolist()
            for j, i in enumerate(sampling):
                states[i].token_ids.append(tokens[j])
                states[i].output_token_ids.append(tokens[j])
                sampled_lists[i] = [tokens[j]]
                logprobs[i] = out.logprobs[j]
        # after sampling: an int8 head writes every call's logits into the buffer it reuses
        prompt_lps = self._prompt_logprobs(states, computed, num_sched, ends, hidden)
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs, prompt_lps)

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
                logits = self.model.compute_logits(hidden[start : start + last - c])
                targets = torch.tensor(s.token_ids[c + 1 : last + 1], device=self.device)
                entries.extend(compute_prompt_logprobs(logits, targets, num_top))
            result.append(entries)
        return result
