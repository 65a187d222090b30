"""Token embedding without random initialization.

Weights always come from a checkpoint, so there is nothing to initialize; `nn.Embedding` would
draw `normal_` values, which on the meta device imports torch._dynamo (~2-3 s of start-up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [num_tokens, embedding_dim]
