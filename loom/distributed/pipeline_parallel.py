"""Pipeline parallel: a Llama-family model's layers split into consecutive stages, one a rank.

Rank r keeps layers [start_r, end_r) (as even as possible, the first stages taking the
remainder) and their KV caches. A step: stage 0 embeds the tokens and runs its layers, sends
the hidden states and the residual stream to stage 1 (torch.distributed point to point), and
so on; the last stage applies the final norm and broadcasts the final hidden states to every
rank, each of which computes the logits with its own copy of the LM head (so every rank
samples the same tokens, as under tensor parallel). A step of several requests goes through
as micro-batches (consecutive groups of requests, as many as stages), so the stages overlap:
stage 0 runs the second group while stage 1 runs the first. A single request is not split.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from loom.attention.forward_context import get_forward_context
from loom.attention.metadata import AttentionMetadata, build_attention_metadata
from loom.config import ConfigError, ModelConfig
from loom.models.llama import LlamaModel


def stage_range(num_layers: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(num_layers, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_splittable(model: nn.Module, config: ModelConfig, world: int) -> None:
    if type(getattr(model, "model", None)) is not LlamaModel:
        raise ConfigError("--pipeline-parallel-size > 1 runs Llama, Mistral and Qwen models "
                          f"(not {config.architecture})")
    if config.num_hidden_layers < world:
        raise ConfigError(f"--pipeline-parallel-size {world} exceeds the number of layers "
                          f"({config.num_hidden_layers})")


def split_stages(model: nn.Module, config: ModelConfig, rank: int, world: int) -> ModelConfig:
    """Keep rank `rank`'s layers of `model` (in place); returns the stage's config."""
    check_splittable(model, config, world)
    start, end = stage_range(config.num_hidden_layers, rank, world)
    inner = model.model  # type: ignore[attr-defined]
    inner.layers = nn.ModuleList(list(inner.layers)[start:end])
    inner.stack = False  # the one-call C stack runs every layer
    inner.pp_rank, inner.pp_world = rank, world
    inner.__class__ = LlamaStage
    layer_types = config.layer_types[start:end] if config.layer_types else config.layer_types
    return replace(config, num_hidden_layers=end - start, layer_types=layer_types)


def micro_batches(md: AttentionMetadata, parts: int) -> list[tuple[int, int]]:
    """The step's requests in at most `parts` consecutive groups of about equal tokens, as
    [request start, request end) pairs (one group when there is one request)."""
    qsl = md.query_start_loc.tolist()
    num_reqs = len(qsl) - 1
    parts = min(parts, num_reqs)
    bounds = [0]
    for k in range(1, parts):
        lo, hi = bounds[-1] + 1, num_reqs - (parts - k)  # every later group keeps a request
        if lo > hi:
            break
        target = qsl[-1] * k / parts
        bounds.append(next((i for i in range(lo, hi + 1) if qsl[i] >= target), hi))
    bounds.append(num_reqs)
    return list(zip(bounds, bounds[1:]))


def _sub_metadata(md: AttentionMetadata, r0: int, r1: int) -> AttentionMetadata:
    """The metadata of requests [r0, r1) of the step alone."""
    qsl = md.query_start_loc.tolist()
    lens = md.seq_lens.tolist()
    computed = md.computed[r0:r1].tolist()
    num_blocks = [-(-n // md.block_size) for n in lens[r0:r1]]
    table = md.block_tables[r0:r1].tolist()
    return build_attention_metadata(
        [row[:n] for row, n in zip(table, num_blocks)], computed,
        [qsl[r + 1] - qsl[r] for r in range(r0, r1)], md.block_size,
        md.block_tables.device, md.workspace)[0]


class LlamaStage(LlamaModel):
    """A LlamaModel holding one stage's layers (made by split_stages, never built).

    A step with several requests goes through the stages as micro-batches (consecutive groups
    of requests, one per stage): while stage 1 runs the first group, stage 0 runs the second.
    The hidden states of every group reach every rank after all groups have passed."""

    pp_rank: int
    pp_world: int
    micro_batched_steps: int = 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: np.ndarray | None = None
    ) -> torch.Tensor:
        """LlamaModel.forward across the stages: every rank returns the final hidden states."""
        ctx = get_forward_context()
        md = ctx.attn_metadata
        groups = micro_batches(md, self.pp_world)
        if len(groups) == 1:
            return self._broadcast(self._run(input_ids, positions, keep), len(input_ids), keep)
        self.micro_batched_steps += 1
        qsl = md.query_start_loc.tolist()
        rows = np.asarray([], dtype=np.int64) if keep is None else keep
        parts = []
        try:
            for r0, r1 in groups:
                t0, t1 = qsl[r0], qsl[r1]
                sub_keep = None if keep is None else rows[(rows >= t0) & (rows < t1)] - t0
                ctx.attn_metadata = _sub_metadata(md, r0, r1)
                parts.append((self._run(input_ids[t0:t1], positions[t0:t1], sub_keep),
                              t1 - t0, sub_keep))
        finally:
            ctx.attn_metadata = md
        # after every group has left this stage: the final hidden states, group by group
        return torch.cat([self._broadcast(*part) for part in parts])

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor,
             keep: np.ndarray | None) -> torch.Tensor | None:
        """This stage's layers on one group: receive, run, send on (None), or on the last
        stage the final-normed hidden states."""
        first, last = self.pp_rank == 0, self.pp_rank == self.pp_world - 1
        weight = self.norm.weight
        n, hidden_size = input_ids.shape[0], weight.shape[0]
        if first:
            x = self.embed(input_ids)  # [num_tokens, hidden]
            residual = None
        else:
            x = torch.empty(n, hidden_size, dtype=weight.dtype, device=weight.device)
            residual = torch.empty_like(x)
            dist.recv(x, src=self.pp_rank - 1)
            dist.recv(residual, src=self.pp_rank - 1)
        x, residual = self.run_layers(x, residual, positions, keep if last else None)
        if not last:
            dist.send(x.contiguous(), dst=self.pp_rank + 1)
            dist.send(residual.contiguous(), dst=self.pp_rank + 1)
            return None
        return self.norm.add_norm(x, residual)[0].contiguous() if x.shape[0] else x

    def _broadcast(self, out: torch.Tensor | None, n: int,
                   keep: np.ndarray | None) -> torch.Tensor:
        """The last stage's final hidden states of one group, on every rank."""
        if out is None:
            weight = self.norm.weight
            m = n if keep is None else len(keep)
            out = torch.empty(m, weight.shape[0], dtype=weight.dtype, device=weight.device)
        if out.shape[0]:
            dist.broadcast(out, src=self.pp_world - 1)
        return out
