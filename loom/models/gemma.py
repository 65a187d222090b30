"""Gemma 2 and Gemma 3 (text) decoders on a flattened token batch.

What sets them apart from Llama: four RMSNorms a layer (before and after attention and MLP), each
scaling by (1 + w); embeddings scaled by sqrt(hidden) in the weight dtype; a GELU-tanh MLP;
sliding-window layers interleaved with global ones (Gemma 3: each kind with its own RoPE base);
an attention scale of query_pre_attn_scalar ** -0.5; Gemma 3's q/k norms; Gemma 2's attention
and final-logit soft-capping. The (1 + w) of every norm is folded into its weight at load, so
the norms are Loom's plain RMSNorm (and its CPU kernel).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from loom.config import ModelConfig
from loom.kernels import cpu_ops
from loom.layers.embedding import VocabEmbedding
from loom.layers.norm import RMSNorm
from loom.layers.rotary import Rope, RotaryEmbedding
from loom.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.sliding = config.layer_window(layer) is not None
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(
        self, ropes: tuple[Rope, Rope], x: torch.Tensor, residual: torch.Tensor | None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: (this layer's normed MLP output, the residual stream
        before it); `ropes` is (global, sliding)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        x = self.self_attn(ropes[self.sliding], x)
        if keep is not None:
            x, residual = x[keep], residual[keep]
            if not len(keep):
                return x, residual
        x, residual = self.pre_feedforward_layernorm.add_norm(
            self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.normalizer = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # Gemma 3's sliding layers rotate with their own base, unscaled; Gemma 2 shares one.
        self.rotary_local = self.rotary_emb
        if config.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_local_theta, None
            )

    def c_stack(self) -> None:
        """The one-call C stack runs Llama layers only (LlamaForCausalLM.forward_logits asks)."""
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: np.ndarray | None = None
    ) -> torch.Tensor:
        """As LlamaModel.forward: final-normed hidden states [num_tokens, hidden] (or `keep`'s)."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # Hugging Face scales by sqrt(hidden) rounded to the weights' dtype.
        x = x * torch.tensor(self.normalizer, dtype=x.dtype)
        fused = cpu_ops.usable(x)
        glob = Rope(self.rotary_emb, positions, fused)
        local = glob if self.rotary_local is self.rotary_emb else Rope(
            self.rotary_local, positions, fused)
        residual = None
        last = len(self.layers) - 1
        rows = None if keep is None else torch.from_numpy(keep).to(x.device)
        for i, layer in enumerate(self.layers):
            x, residual = layer((glob, local), x, residual, rows if i == last else None)
        if not x.shape[0]:
            return x
        return self.norm.add_norm(x, residual)[0]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 text models (registered under both names)."""

    model_cls = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [n, vocab]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def c_stack_refusal(self) -> str | None:
        return f"architecture {self.config.architecture}"

    def init_buffers(self, device: torch.device) -> None:
        self.model.rotary_emb.build_cache(device)
        if self.model.rotary_local is not self.model.rotary_emb:
            self.model.rotary_local.build_cache(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_fold_norms(weights))


def _fold_norms(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every Gemma norm scales by (1 + w) in fp32: the weight loaded is 1 + w."""
    for name, w in weights:
        yield name, (w.float() + 1.0 if name.endswith("norm.weight") else w)
