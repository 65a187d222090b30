"""The draft-model proposer of speculative decoding (`{"method": "draft_model", "model": ...}`):
a smaller model with the same vocabulary, run by its own ModelRunner with its own KV cache,
proposes k tokens per decoding request each step: a greedy request's greedily, a sampled
request's drawn with its temperature, top-k, top-p and min-p from a generator of the
proposer's (one a request, seeded from the request's seed where it has one), the distribution
of each kept for the target's rejection sampling (which then accepts a draft token d with
probability min(1, p(d) / q(d)): the output distribution stays the target's).

Per request the draft cache holds the KV of a prefix of the request's tokens (`seen`); each
step it first computes the tokens it has not seen (the prompt, the last step's accepted and
sampled tokens: whatever differs from what it drafted), then k - 1 one-token steps, all
requests in one batch per step. Rejected draft tokens simply stop counting as seen. A greedy
draft is a point mass, so the target's verification (loom.worker.spec_verify) is exact.

A hybrid draft model (Qwen3.5, LFM2, Granite 4.0-H, ...: layers with a state per request) keeps
no draft token in what it has seen: its runner keeps a copy of the states after each
request's known tokens (its prefix-caching snapshots, keyed per request and length), the next
step starts from that copy and computes the tokens since (the kept drafts among them) again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from loom.config import CacheConfig, ConfigError
from loom.core.kv_cache_manager import KVCacheManager
from loom.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from loom.layers.recurrent import state_bytes
from loom.loader.model_loader import load_model, resolve_dtype
from loom.loader.resolve import resolve_model
from loom.sampling_params import SamplingParams
from loom.worker.kv_cache import determine_num_blocks, kv_cache_dtype
from loom.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from loom.config import ModelConfig
    from loom.engine.args import EngineArgs
    from loom.request import Request

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
_SEED_MIX = 0x9E3779B97F4A7C15  # a seeded request's draft draws: a stream apart from its own


def _draft_params(params: SamplingParams) -> SamplingParams:
    """What the draft model samples a request's draft with: its truncation and temperature
    (penalties, logit_bias and the like change only the target's distribution, which the
    rejection sampling compares against)."""
    if params.greedy:
        return _GREEDY
    return SamplingParams(temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, min_p=params.min_p, max_tokens=1,
                          ignore_eos=True)


@dataclass
class _Seq:
    """What KVCacheManager needs of a request (it reads sampling_params only with caching)."""

    request_id: str
    num_computed_tokens: int


class DraftModelProposer:
    def __init__(self, args: EngineArgs, model: str, target: ModelConfig, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        loaded = load_model(resolve_model(model), args.dtype, device,
                            quantization=args.quantization, cpu_kernels=args.cpu_kernels,
                            batch_invariant=args.batch_invariant)
        config = loaded.config
        if config.vocab_size != target.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({config.vocab_size} tokens) is not "
                              f"the target's ({target.vocab_size})")
        if config.max_position_embeddings < max_model_len:
            raise ConfigError(f"the draft model's context ({config.max_position_embeddings}) is "
                              f"shorter than max_model_len ({max_model_len})")
        kv_dtype = kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype, device))
        if args.kv_cache_dtype == "auto":
            kv_dtype = loaded.default_kv_cache_dtype() or kv_dtype
        num_blocks = determine_num_blocks(
            CacheConfig(block_size=block_size, enable_prefix_caching=False,
                        kv_cache_memory=args.kv_cache_memory,
                        num_gpu_blocks_override=args.num_gpu_blocks_override),
            config, kv_dtype, device, max_needed_tokens=2 * args.max_num_seqs * max_model_len)
        # a hybrid's states: a slot a request, and room for a kept copy of each's
        self.hybrid = bool(config.linear_layers)
        slots = args.max_num_seqs
        self.runner = ModelRunner(loaded.model, config, (), block_size, num_blocks, kv_dtype,
                                  device, max_num_seqs=slots,
                                  state_cache_bytes=(slots + 1) * state_bytes(loaded.model))
        self.kv = KVCacheManager(num_blocks, block_size, False, max_model_len)
        self.seen: dict[str, list[int]] = {}  # per request: the tokens its draft KV holds
        # a hybrid's: per request, the tokens its kept states follow and their snapshot's key
        self.kept: dict[str, tuple[list[int], object]] = {}
        self._stale: set[str] = set()  # runner states to drop at the next call
        self.runner.kept_probs = {}  # sampled drafts' distributions (reset each call)
        self._generators: dict[str, torch.Generator] = {}  # a sampled request's draws
        self._probs: dict[str, torch.Tensor] = {}  # req_id -> its last draft's [k, vocab]

    def propose(self, requests: list[Request], num_tokens: list[int]) -> dict[str, list[int]]:
        """Up to num_tokens[i] draft tokens for requests[i] (fewer without KV blocks): greedy,
        or for a sampled request drawn as it samples (their distributions: `probs`)."""
        new, ks, computed = [], {}, {}
        for r, k in zip(requests, num_tokens):
            tokens = list(r.all_token_ids)
            seq = _Seq(r.request_id, _common_prefix(self.seen.get(r.request_id, []), tokens))
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(tokens) - 1)
            key = None
            if self.hybrid:  # from its kept states, where they follow these tokens
                kept, key = self.kept.get(r.request_id, ([], None))
                if not (0 < len(kept) < len(tokens) and tokens[: len(kept)] == kept
                        and key in self.runner.snapshots):
                    kept, key = [], None
                seq.num_computed_tokens = len(kept)
            self.kv.trim(seq, seq.num_computed_tokens)
            if self.kv.allocate_slots(seq, len(tokens) + k - 1 - seq.num_computed_tokens) is None:
                continue  # no room in the draft cache: no draft this step
            params = _draft_params(r.sampling_params)
            new.append(NewRequestData(r.request_id, tokens, len(tokens), params,
                                      self.kv.get_block_ids(r.request_id),
                                      seq.num_computed_tokens, state_key=key,
                                      generator=None if params.greedy
                                      else self._generator(r)))
            ks[r.request_id], computed[r.request_id] = k, len(tokens)
            self.seen[r.request_id] = tokens
        drafts: dict[str, list[int]] = {rid: [] for rid in ks}
        self.runner.kept_probs = {}
        so = SchedulerOutput(new, CachedRequestData(),
                             {n.req_id: len(n.token_ids) - n.num_computed_tokens for n in new},
                             0, self._stale)
        stale = []  # kept states replaced this step, dropped once its first call restored them
        if self.hybrid:  # the states after each request's known tokens, kept
            so.state_keys = {n.req_id: (n.req_id, len(n.token_ids)) for n in new}
            for n in new:
                old = self.kept.get(n.req_id, (None, None))[1]
                self.kept[n.req_id] = (n.token_ids, so.state_keys[n.req_id])
                if old is not None and old != so.state_keys[n.req_id]:
                    stale.append(old)
        self._stale = set(ks)
        for step in range(max(ks.values(), default=0)):
            if step:  # one token more for each request still drafting
                live = [rid for rid, k in ks.items() if k > step and len(drafts[rid]) == step]
                if not live:
                    break
                cached = CachedRequestData(live, [[] for _ in live],
                                           [computed[rid] + step - 1 for rid in live])
                so = SchedulerOutput([], cached, dict.fromkeys(live, 1), 0, set())
            so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
            out = self.runner.execute_model(so)
            for key in stale if step == 0 else ():
                self.runner.snapshots.drop(key)  # type: ignore[union-attr]
            for rid, sampled in zip(out.req_ids, out.sampled_token_ids):
                if rid not in out.failed and sampled:
                    drafts[rid].extend(sampled)
        for rid, tokens in drafts.items():
            self.seen[rid] = self.seen[rid] + tokens[:-1]  # the last one's KV is not computed
        self._probs = {rid: torch.stack(rows[: len(drafts[rid])])
                       for rid, rows in self.runner.kept_probs.items() if drafts.get(rid)}
        return drafts

    def probs(self, req_id: str) -> torch.Tensor | None:
        """The distributions the request's last draft (a sampled request's) was drawn from."""
        return self._probs.get(req_id)

    def _generator(self, request: Request) -> torch.Generator:
        """The request's draft draws, across steps: from its seed if it has one (reproducible),
        else from torch's default generator's next draw."""
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = request.sampling_params.seed
            gen = self._generators[request.request_id] = torch.Generator(device=self.runner.device)
            gen.manual_seed(int(torch.randint(2**62, ())) if seed is None
                            else (seed * _SEED_MIX + 1) & 0xFFFFFFFFFFFFFFFF)
        return gen

    def drop(self, req_id: str) -> None:
        self.kv.free(_Seq(req_id, 0))
        self.seen.pop(req_id, None)
        self._generators.pop(req_id, None)
        self._probs.pop(req_id, None)
        self._stale.add(req_id)
        kept = self.kept.pop(req_id, None)
        if kept is not None and self.runner.snapshots is not None:
            self.runner.snapshots.drop(kept[1])


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of a and b's common prefix, compared in C (they are whole sequences; only the
    last few tokens, the drafts, ever differ)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0])
