"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over persistent
input buffers.

A decode-only step (every request computes one token and samples it) of n requests runs the
graph of the smallest bucket >= n. Its inputs are copied into buffers the graph captured
(device to device: the step's metadata is already on the GPU), and rows n.. bucket are padding
that cannot touch real state:
- input id 0 at position 0, so every op computes finite numbers;
- slot -1, which the Triton K/V write skips (no cache slot is written);
- one token of context whose block-table entry is the null block 0 (never written, zeroed),
  so its attention reads finite zeros;
- their logits rows are dropped.
The query_start_loc of a decode step is 0..n, the same for every step, so it is written once.
The Triton attention kernel's key splits are fixed per bucket at capture (num_kv_splits), as
a replay cannot choose them. Every attention layer must run the Triton kernels: the torch
reference reads host-side metadata a replay would not refresh.

Only the CUDA runner builds this (ModelRunner.capture_cuda_graphs, not with
--enforce-eager); the padding and buffer logic (`fill`, `forward_padded`) also runs on the CPU,
where the tests check it with the Triton kernels in their interpreter.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from loom.attention.backends import triton_attn
from loom.attention.forward_context import set_forward_context
from loom.attention.metadata import AttentionMetadata, Workspace

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and
    max_num_seqs itself). Example: 40 -> [1, 2, 4, 8, 16, 32, 40]."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n rows; None past the largest."""
    for size in sizes:
        if size >= n:
            return size
    return None


class DecodeGraphs:
    def __init__(
        self, model: nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
        num_kv_heads: int, device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.device = device
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        i64 = dict(dtype=torch.int64, device=device)
        # Persistent inputs: a replay reads these addresses. [n] rows of one decode each.
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.query_start_loc = torch.arange(n + 1, **i64)  # one query token a request, always
        self.seq_lens = torch.ones(n, **i64)
        self.block_tables = torch.zeros(n, max_blocks, **i64)
        sms = triton_attn.num_sms(device)
        self.num_kv_splits = {  # fixed per bucket: a replay cannot choose
            size: triton_attn.choose_num_splits(size, num_kv_heads, max_model_len, sms)
            for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # hidden, logits
        self.pool = None

    def can_run(self, num_reqs: int, md: AttentionMetadata) -> bool:
        return (md.max_query_len == 1 and md.num_tokens == num_reqs
                and bucket_for(num_reqs, self.sizes) is not None
                and md.block_tables.shape[1] <= self.block_tables.shape[1])

    def fill(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
             md: AttentionMetadata) -> None:
        """Copy a decode step of n <= size requests into the buffers; rows n..size pad."""
        n = input_ids.shape[0]
        width = md.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.seq_lens[n:size].fill_(1)
        # Columns past `width` of real rows are never read (their seq_len stops before).
        self.block_tables[:n, :width].copy_(md.block_tables)
        self.block_tables[n:size, 0].zero_()

    def metadata(self, size: int) -> AttentionMetadata:
        """The buffers' first `size` rows as a decode step's metadata."""
        return AttentionMetadata(
            num_tokens=size, slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], max_query_len=1,
            positions=self.positions[:size], workspace=Workspace(), block_size=self.block_size,
            req_idx=np.arange(size), computed=np.zeros(size, dtype=np.int64),
            num_kv_splits=self.num_kv_splits[size],
        )

    def forward_padded(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model on the buffers' first `size` rows: (hidden [size, h], logits [size, V])."""
        with set_forward_context(self.metadata(size)):
            hidden = self.model.model(self.input_ids[:size], self.positions[:size])
            return hidden, self.model.compute_logits(hidden)

    def capture(self) -> None:
        """One graph per bucket, the largest first so the smaller ones reuse its memory pool.
        The buffers hold padding only (every row a pad) while capturing."""
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.slot_mapping[:size].fill_(-1)
            self.forward_padded(size)  # warm-up: Triton compiles, allocators settle
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.forward_padded(size)
            self.graphs[size] = graph
        logger.info("captured CUDA graphs for decode batches of %s", self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step of n requests: (hidden [n, h], logits [n, V]), by graph replay where
        captured, else eagerly on the same padded buffers (the CPU tests)."""
        n = input_ids.shape[0]
        size = bucket_for(n, self.sizes)
        assert size is not None
        self.fill(size, input_ids, positions, md)
        graph = self.graphs.get(size)
        if graph is None:
            hidden, logits = self.forward_padded(size)
        else:
            graph.replay()
            hidden, logits = self.outputs[size]
        return hidden[:n], logits[:n]
