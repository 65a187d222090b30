"""Token embeddings: float (without random initialization), or a GGUF file's K-quant blocks.

Weights always come from a checkpoint, so there is nothing to initialize; `nn.Embedding` would
draw `normal_` values, which on the meta device imports torch._dynamo (~2-3 s of start-up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.quant.kquant import KBlocks


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [num_tokens, embedding_dim]


class KQuantEmbedding(nn.Module):
    """Token embeddings kept in a GGUF file's K-quant blocks (KBlocks, views of the file's
    memory map): the rows a step looks up are dequantized then, the fp32 reference's values bit
    for bit, and the table takes the file's bytes (SmolLM2-1.7B's Q6_K table: 80 MiB, 384 MiB in
    fp32). A tied output projection (a KQuantLinear) multiplies by the same blocks."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.blocks: KBlocks | None = None
        # what loom.models.weight_map counts rows by; a tied head shares it
        self.weight_int8 = torch.empty((num_embeddings, 0), dtype=torch.uint8)

    @property
    def weight(self) -> torch.Tensor:
        """An empty fp32 tensor: the activations' dtype and device (the table is `blocks`)."""
        return torch.empty(0)

    def load_rows(self, rows: slice | None, w: KBlocks) -> int:
        """The whole table, as the checkpoint's blocks."""
        shape = (self.num_embeddings, self.embedding_dim)
        if rows is not None or not isinstance(w, KBlocks) or tuple(w.shape) != shape:
            raise ValueError(f"expected the whole table {shape} in K-quant blocks, got "
                             f"{type(w).__name__} {tuple(w.shape)}")
        self.blocks = KBlocks(w.data.contiguous(), w.qtype, w.cols)
        return self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.blocks is not None, "KQuantEmbedding used before its weights were loaded"
        ids = input_ids.reshape(-1)
        rows = KBlocks(self.blocks.data.index_select(0, ids), self.blocks.qtype, self.blocks.cols)
        return rows.dequantize().view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        fmt = "?" if self.blocks is None else self.blocks.qtype.name
        return f"{self.num_embeddings}, {self.embedding_dim}, {fmt}"
