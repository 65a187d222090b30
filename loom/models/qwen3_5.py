"""Qwen3.5 (dense, text): a hybrid of Gated DeltaNet linear-attention layers and gated attention.

Three layers in four (the config's `layer_types`) mix tokens with linear attention whose state
is a fixed size per request (loom/layers/gated_delta.py); the others attend over the KV cache
with Qwen3's per-head q/k norms, a partial rotary (a quarter of each head by default), and
the heads' output times sigmoid of a gate projection whose rows sit beside q's, head by head,
in the checkpoint's q_proj. Every norm but the linear layers' output norm scales by (1 + w),
folded into the weight at load. Each layer's MLP is Llama's.

Runs layer by layer (not the one-call C stack); the engine turns off what a per-request state
cannot follow: prefix caching, speculative decoding, CUDA graphs, tensor / pipeline
parallelism (LLMEngine, spec_decoder).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from loom.attention.layer import Attention
from loom.config import ModelConfig
from loom.layers.gated_delta import GatedDeltaNet
from loom.layers.linear import Linear
from loom.layers.norm import RMSNorm
from loom.layers.rotary import Rope
from loom.models.llama import (
    LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel,
)


class GatedAttention(LlamaAttention):
    """Attention whose heads' output is multiplied by sigmoid(o_gate(x)) before o_proj."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.o_gate = Linear(config.hidden_size, self.q_size, bias=config.attention_bias)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.o_gate(x))
        return self.o_proj(self.attend(rope, x) * gate)


class HybridDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose token mixer is linear attention (`linear_attn`) in the config's
    linear layers, gated attention (`self_attn`) in the others."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)
        self.is_linear = layer in config.linear_layers
        if self.is_linear:
            assert config.linear_attn is not None
            self.linear_attn = GatedDeltaNet(config.hidden_size, config.linear_attn,
                                             config.rms_norm_eps)
        else:
            self.self_attn = (GatedAttention(config, layer) if config.attn_output_gate
                              else LlamaAttention(config, layer))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        return self.linear_attn(x) if self.is_linear else self.self_attn(rope, x)


class HybridModel(LlamaModel):
    layer_cls = HybridDecoderLayer


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    model_cls = HybridModel
    packed_modules = {
        **LlamaForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    def c_stack_refusal(self) -> str | None:
        return "its linear-attention (Gated DeltaNet) layers"

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def recurrent_layers(self) -> list[GatedDeltaNet]:
        """The layers holding a state per request (the model runner binds their slots)."""
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def shard_sizes(self, param_name: str) -> list[int] | None:
        """The linear layers' packed in_proj rows (weight_map._shard_slice)."""
        if ".linear_attn.in_proj." not in param_name:
            return None
        return self.recurrent_layers()[0].shard_sizes()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_checkpoint_weights(weights, self.config))


def _checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3.5's tensors as the layers hold them: (1 + w) norms folded (the linear layers'
    output norm is plain w), each head's q rows and gate rows of q_proj apart (q_proj and
    o_gate), the convolution's [channels, 1, width] weight squeezed; the multi-token
    prediction head (`mtp.`), which Loom does not run, left out."""
    D, heads = config.head_dim, config.num_attention_heads
    first = (torch.arange(heads)[:, None] * 2 * D + torch.arange(D)).reshape(-1)
    for name, w in weights:
        if name.startswith("mtp."):
            continue
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w.float() + 1.0
        elif name.endswith("linear_attn.conv1d.weight"):
            w = w.reshape(w.shape[0], -1)
        elif config.attn_output_gate and ".self_attn.q_proj." in name:
            for part, index in (("q_proj", first), ("o_gate", first + D)):
                rows = (w.map_rows(lambda a, i=index: a[i]) if hasattr(w, "map_rows")
                        else w.index_select(0, index))
                yield name.replace(".q_proj.", f".{part}."), rows
            continue
        yield name, w
