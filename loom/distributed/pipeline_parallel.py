"""Pipeline parallel: a Llama-family model's layers split into consecutive stages, one a rank.

Rank r keeps layers [start_r, end_r) (as even as possible, the first stages taking the
remainder) and their KV caches. A step: stage 0 embeds the tokens and runs its layers, sends
the hidden states and the residual stream to stage 1 (torch.distributed point to point), and
so on; the last stage applies the final norm and broadcasts the final hidden states to every
rank, each of which computes the logits with its own copy of the LM head (so every rank
samples the same tokens, as under tensor parallel). The stages of one step run one after
another: micro-batches in flight (stage 0 on the next part of the step while stage 1 runs
this one) are not implemented.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.kernels import cpu_ops
from loom.layers.rotary import Rope
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


class LlamaStage(LlamaModel):
    """A LlamaModel holding one stage's layers (made by split_stages, never built)."""

    pp_rank: int
    pp_world: int

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: np.ndarray | None = None
    ) -> torch.Tensor:
        """LlamaModel.forward across the stages: every rank returns the final hidden states."""
        first, last = self.pp_rank == 0, self.pp_rank == self.pp_world - 1
        weight = self.norm.weight
        n, hidden_size = input_ids.shape[0], weight.shape[0]
        if first:
            x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
            residual = None
        else:
            x = torch.empty(n, hidden_size, dtype=weight.dtype, device=weight.device)
            residual = torch.empty_like(x)
            dist.recv(x, src=self.pp_rank - 1)
            dist.recv(residual, src=self.pp_rank - 1)
        rope = Rope(self.rotary_emb, positions, fused=cpu_ops.usable(x))
        rows = None if keep is None else torch.from_numpy(keep).to(x.device)
        for i, layer in enumerate(self.layers):
            at_end = last and i == len(self.layers) - 1
            x, residual = layer(rope, x, residual, rows if at_end else None)
        if not last:
            dist.send(x.contiguous(), dst=self.pp_rank + 1)
            dist.send(residual.contiguous(), dst=self.pp_rank + 1)
            m = n if keep is None else len(keep)
            out = torch.empty(m, hidden_size, dtype=weight.dtype, device=weight.device)
        else:
            out = self.norm.add_norm(x, residual)[0].contiguous() if x.shape[0] else x
        if out.shape[0]:
            dist.broadcast(out, src=self.pp_world - 1)
        return out
