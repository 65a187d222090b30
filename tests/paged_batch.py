"""Drive a Loom model directly on the paged KV cache, without the scheduler (model tests)."""

from __future__ import annotations

import numpy as np
import torch

from loom.attention.forward_context import set_forward_context
from loom.attention.metadata import build_attention_metadata
from loom.worker.kv_cache import allocate_kv_caches

BLOCK = 16


class PagedBatch:
    """Drives Loom's model directly: each request owns blocks; steps mix prefill and decode."""

    def __init__(self, loaded, num_blocks: int = 64, device: torch.device = torch.device("cpu"),
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = loaded.model
        self.device = device
        caches = allocate_kv_caches(loaded.config, num_blocks, BLOCK, kv_dtype or loaded.dtype,
                                    device)
        for attn, cache in zip(self.model.attention_layers(), caches):
            attn.kv_cache = cache
        self.next_block = 1  # block 0 is the null block
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        # the last step's logits of each request's last row: by forward_logits, by the head
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        # a hybrid model's linear layers: a state slot a request, as the model runner gives
        self.hybrid = hasattr(self.model, "recurrent_layers")
        self.slots: dict[str, int] = {}
        for layer in self.model.recurrent_layers() if self.hybrid else ():
            layer.allocate_states(16, device)

    def add(self, rid: str, shared_blocks: list[int] = (), num_cached: int = 0) -> None:
        assert not (self.hybrid and num_cached), "a hybrid model's states are not cached"
        self.blocks[rid] = list(shared_blocks)
        self.computed[rid] = num_cached
        self.slots[rid] = len(self.slots)

    def _ensure_blocks(self, rid: str, num_tokens: int) -> None:
        while len(self.blocks[rid]) * BLOCK < num_tokens:
            self.blocks[rid].append(self.next_block)
            self.next_block += 1

    def _inputs(self, work: dict[str, list[int]]):
        """Blocks for `work`, then (rids, attention metadata, positions, ids, each request's end
        row + 1) for the step."""
        rids = list(work)
        for rid in rids:
            if rid not in self.blocks:
                self.add(rid)
            self._ensure_blocks(rid, self.computed[rid] + len(work[rid]))
        md, positions = build_attention_metadata(
            [self.blocks[r] for r in rids], [self.computed[r] for r in rids],
            [len(work[r]) for r in rids], BLOCK, self.device,
        )
        if self.hybrid:
            md.state_slots = np.array([self.slots[r] for r in rids], dtype=np.int64)
        ids = torch.tensor([t for r in rids for t in work[r]], device=self.device)
        ends = np.cumsum([len(work[r]) for r in rids])
        for rid in rids:
            self.computed[rid] += len(work[rid])
        return rids, md, torch.from_numpy(positions).to(self.device), ids, ends

    @torch.inference_mode()
    def step(self, work: dict[str, list[int]], sample: list[str] | None = None
             ) -> dict[str, torch.Tensor]:
        """work: rid -> new token ids to compute. Returns rid -> logits [len(new), vocab].

        With `sample` (the rids whose last row samples), the model runner's call instead: the
        last layer's MLP runs on those rows alone; returns rid -> that row's logits [1, vocab]
        and sets `last` to (forward_logits' logits, the head module's of the hidden rows)."""
        rids, md, positions, ids, ends = self._inputs(work)
        if sample is not None:
            rows = np.array([ends[i] - 1 for i, r in enumerate(rids) if r in sample],
                            dtype=np.int64)
            with set_forward_context(md):
                hidden, last = self.model.forward_logits(ids, positions, rows, only_rows=True)
                assert hidden.shape[0] == len(rows)
                self.last = (None if last is None else last.clone(),
                             self.model.compute_logits(hidden).clone())
            got = self.last[0] if self.last[0] is not None else self.last[1]
            return {r: got[j : j + 1] for j, r in enumerate(r for r in rids if r in sample)}
        with set_forward_context(md):
            # each request's last row's logits as the runner asks for them (the int8 C stack
            # runs the head in its call), and as the head module computes them
            hidden, last = self.model.forward_logits(ids, positions, ends - 1)
            # copies: an int8 head writes its logits into one buffer it reuses (Int8Linear)
            last = last.clone()
            self.last = (last, self.model.compute_logits(hidden[ends - 1]).clone())
            logits = self.model.compute_logits(hidden).clone()
        out, start = {}, 0
        for rid in rids:
            n = len(work[rid])
            out[rid] = logits[start : start + n]
            start += n
        return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def greedy(loaded, prompts: dict[str, list[int]], steps: int, num_blocks: int = 64):
    """Prefill every prompt in one step, then `steps` greedy decode steps of all together.
    Returns (rid -> prompt + generated ids, rid -> each generated token's logits [steps, vocab])."""
    batch = PagedBatch(loaded, num_blocks=num_blocks)
    seqs = {r: list(p) for r, p in prompts.items()}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}
    out = batch.step(prompts)
    for _ in range(steps):
        for r in seqs:
            logits[r].append(out[r][-1])
            seqs[r].append(int(out[r][-1].argmax()))
        out = batch.step({r: s[-1:] for r, s in seqs.items()})
    return seqs, {r: torch.stack(v) for r, v in logits.items()}
