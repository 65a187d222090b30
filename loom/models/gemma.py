"""Gemma 2 and Gemma 3 (text) decoders on a flattened token batch, and Gemma 1.

What sets them apart from Llama: four RMSNorms a layer (before and after attention and MLP), each
scaling by (1 + w); embeddings scaled by sqrt(hidden) in the weight dtype; a GELU-tanh MLP;
sliding-window layers interleaved with global ones (Gemma 3: each kind with its own RoPE base);
an attention scale of query_pre_attn_scalar ** -0.5; Gemma 3's q/k norms; Gemma 2's attention
and final-logit soft-capping. The (1 + w) of every norm is folded into its weight at load, so
the norms are Loom's plain RMSNorm (and its CPU kernel). Gemma 1 (`GemmaForCausalLM`, GGUF
`gemma`) is Llama's layer (two norms, no windows, no caps) with Gemma's (1 + w) norms, scaled
embeddings and GELU-tanh MLP.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from loom.config import ModelConfig
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding
from loom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GemmaDecoderLayer(LlamaDecoderLayer):
    """A Llama layer with two more norms: after attention (post_attention_layernorm, on
    attention's output alone) and around the MLP (pre_ and post_feedforward_layernorm)."""

    mlp_norm_name = "pre_feedforward_layernorm"
    attn_out_norm_name = "post_attention_layernorm"
    mlp_out_norm_name = "post_feedforward_layernorm"

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.rope_index = int(config.layer_window(layer) is not None)  # (global, sliding)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5
        # Gemma 3's sliding layers rotate with their own base, unscaled; Gemma 2 shares one.
        self.rotary_local = self.rotary_emb
        if config.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_local_theta, None,
                config.rope_dim,
            )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # Hugging Face scales by sqrt(hidden) rounded to the weights' dtype.
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def rotaries(self) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        """(global, sliding)."""
        return self.rotary_emb, self.rotary_local


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 text models (registered under both names)."""

    model_cls = GemmaModel

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_fold_norms(weights))


class Gemma1Model(GemmaModel):
    layer_cls = LlamaDecoderLayer


class Gemma1ForCausalLM(GemmaForCausalLM):
    model_cls = Gemma1Model


def _fold_norms(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every Gemma norm scales by (1 + w) in fp32: the weight loaded is 1 + w."""
    for name, w in weights:
        yield name, (w.float() + 1.0 if name.endswith("norm.weight") else w)
