"""Tensor-parallel layers (Megatron-LM's split, as vLLM's `parallel_state` + linear layers):
each rank holds a slice of a layer's weight and one collective joins the slices.

- ColumnParallelLinear: a slice of the output features; no communication (the next layer
  takes the slice).
- RowParallelLinear: a slice of the input features; its partial products are summed by one
  all-reduce (after attention's o_proj and the MLP's down_proj: one per block).
- VocabParallelEmbedding: a slice of the vocabulary rows; a token outside the slice looks up
  zeros and the all-reduce sums the one nonzero row (exact).
- ParallelLMHead: a slice of the vocabulary columns of the logits, all-gathered.

The group is torch.distributed's default unless given: gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loom.layers.linear import linear


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)  # [out/N, in]
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(),
                                                           requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # [num_tokens, out/N]


class RowParallelLinear(ColumnParallelLinear):
    """Its weight [out, in/N]; the bias (whole) is added once, after the all-reduce."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group=None) -> None:
        super().__init__(weight, bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)  # [num_tokens, out], this rank's partial sum
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, end, rows per rank): rank's vocabulary rows [start, end); every rank holds
    `rows` rows, the last padded with zeros when world does not divide the vocabulary."""
    rows = -(-vocab_size // world)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def vocab_shard(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows of `weight` [vocab, hidden] for `rank`, zero-padded to the common row count."""
    start, end, rows = vocab_range(weight.shape[0], rank, world)
    shard = weight.new_zeros(rows, weight.shape[1])
    shard[: end - start] = weight[start:end]
    return shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full_weight: torch.Tensor, rank: int, world: int, group=None) -> None:
        super().__init__()
        self.start, self.end, _ = vocab_range(full_weight.shape[0], rank, world)
        self.weight = nn.Parameter(vocab_shard(full_weight, rank, world), requires_grad=False)
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside[:, None], 0)  # [num_tokens, hidden]
        dist.all_reduce(x, group=self.group)
        return x


class ParallelLMHead(nn.Module):
    def __init__(self, weight_shard: nn.Parameter, vocab_size: int, world: int,
                 group=None) -> None:
        super().__init__()
        self.weight = weight_shard  # [vocab/N (padded), hidden]; shared when tied
        self.vocab_size = vocab_size
        self.world = world
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight).contiguous()  # [n, vocab/N]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]  # [n, vocab]
