"""Hybrid models: layers whose token mixer keeps a fixed-size state per request
(loom/layers/recurrent.py) beside layers that attend over the KV cache; each layer's MLP is
Llama's.

- Qwen3.5 (dense, text): three layers in four (the config's `layer_types`) mix tokens with
  Gated DeltaNet linear attention (loom/layers/gated_delta.py); the others attend with Qwen3's
  per-head q/k norms, a partial rotary (a quarter of each head by default), and the heads'
  output times sigmoid of a gate projection whose rows sit beside q's, head by head, in the
  checkpoint's q_proj. Every norm but the linear layers' output norm scales by (1 + w), folded
  into the weight at load.
  Its mixtures of experts: every MLP Qwen3-MoE's with a gated shared expert; Qwen3-Next the
  same with its linear layers' inputs packed per key head.
- LFM2 (Liquid): most layers a short gated convolution (ShortConv), the others Llama attention
  with per-head q/k norms; Hugging Face's names mapped to Llama's at load.

Their prompts run layer by layer; on the CPU their decode steps run in the one-call C stack,
the mixers' C decode steps in the call (stack_parts' `mixer`). Prefix caching keeps their
states at block boundaries (loom.layers.recurrent.StateSnapshots); the engine turns off what a per-request
state cannot follow: speculative decoding, CUDA graphs, tensor / pipeline parallelism
(LLMEngine, spec_decoder).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from loom.attention.layer import Attention
from loom.config import ModelConfig
from loom.kernels import cpu_ops
from loom.layers.gated_delta import GatedDeltaNet
from loom.layers.linear import Linear
from loom.layers.mamba2 import Mamba2Mixer
from loom.layers.norm import RMSNorm
from loom.layers.recurrent import DepthwiseConv, RecurrentMixer, ShortConv
from loom.layers.rotary import Rope
from loom.models.llama import (
    LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel,
)
from loom.models.moe import SparseMoeBlock, expert_names, experts_refusal
from loom.models.weight_map import select_rows


class GatedAttention(LlamaAttention):
    """Attention whose heads' output is multiplied by sigmoid(o_gate(x)) before o_proj."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.o_gate = Linear(config.hidden_size, self.q_size, bias=config.attention_bias)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        out, gate = self.attend(rope, x), self.o_gate(x)
        if cpu_ops.usable(out) and out.is_contiguous() and gate.is_contiguous():
            cpu_ops.sigmoid_mul_(out, gate)  # (the C stack's kernel: the same bits)
        else:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class HybridDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose token mixer is the model's recurrent one in the config's linear
    layers (Qwen3.5's `linear_attn`, LFM2's `conv`: the checkpoints' names), attention
    (`self_attn`; Qwen3.5's gated) in the others."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)
        self.is_linear = layer in config.linear_layers
        if layer in config.nope_layers:  # (LlamaModel's second table: no rotation)
            self.rope_index = 1
        if self.is_linear and config.short_conv_width:
            self.conv = ShortConv(config.hidden_size, config.short_conv_width,
                                  config.short_conv_bias)
        elif self.is_linear and config.mamba is not None:
            self.mamba = Mamba2Mixer(config.hidden_size, config.mamba, config.rms_norm_eps)
        elif self.is_linear:
            assert config.linear_attn is not None
            self.linear_attn = GatedDeltaNet(config.hidden_size, config.linear_attn,
                                             config.rms_norm_eps)
        else:
            self.self_attn = (GatedAttention(config, layer) if config.attn_output_gate
                              else LlamaAttention(config, layer))
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer) else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.residual_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.residual_norm_eps)

    @property
    def recurrent(self) -> RecurrentMixer:
        for name in ("conv", "mamba", "linear_attn"):
            if hasattr(self, name):
                return getattr(self, name)
        raise AttributeError("an attention layer has no recurrent mixer")

    def mix(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        return self.recurrent(x) if self.is_linear else self.self_attn(rope, x)

    def stack_parts(self) -> dict[str, object]:
        """LlamaDecoderLayer's, with attention's output gate (`gate`, Qwen3.5's) and a mixture
        of experts (`moe`, as MoeDecoderLayer's); a linear layer's: its mixer (`mixer`) in
        place of attention (the C stack runs it on decode steps)."""
        if not self.is_linear:
            parts = super().stack_parts()
            parts["gate"] = getattr(self.self_attn, "o_gate", None)
        else:
            dense = isinstance(self.mlp, LlamaMLP)
            parts = dict(
                in_norm=self.input_layernorm, mlp_norm=self.post_attention_layernorm,
                q_norm=None, k_norm=None, attn_out_norm=None, mlp_out_norm=None,
                qk_norm_full=False, qkv=None, o=None, attn=None, rope_index=self.rope_index,
                gate_up=self.mlp.gate_up_proj if dense else None,
                down=self.mlp.down_proj if dense else None,
                activation=self.mlp.activation if dense else None, mixer=self.recurrent)
        parts["moe"] = None
        if isinstance(self.mlp, SparseMoeBlock):
            parts["moe"], parts["activation"] = self.mlp, self.mlp.experts[0].activation
        return parts


class HybridModel(LlamaModel):
    layer_cls = HybridDecoderLayer


class HybridForCausalLM(LlamaForCausalLM):
    model_cls = HybridModel

    def c_stack_refusal(self) -> str | None:
        """The stack runs a hybrid's decode steps (its mixers' C decode steps in the call; its
        prompts run layer by layer), its experts as moe.py's."""
        return experts_refusal(self.config)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors under Loom's names (the subclasses' maps), a depthwise
        convolution's [channels, 1, width] weight as its module holds it, [channels, width]."""
        convs = {f"{name}.weight" for name, m in self.named_modules()
                 if isinstance(m, DepthwiseConv)}
        super().load_weights(
            (name, w.reshape(w.shape[0], -1) if name in convs and w.dim() == 3 else w)
            for name, w in weights)

    def recurrent_layers(self) -> list[RecurrentMixer]:
        """The layers holding a state per request (the model runner binds their slots)."""
        return [layer.recurrent for layer in self.model.layers if layer.is_linear]


class Qwen3_5ForCausalLM(HybridForCausalLM):
    """Qwen3.5 and its mixtures of experts (35B-A3B and up: every layer's MLP a mixture with a
    shared expert behind a sigmoid gate, moe.py's SparseMoeBlock)."""

    packed_modules = {
        **LlamaForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    def shard_sizes(self, param_name: str) -> list[int] | None:
        """The linear layers' packed in_proj rows (weight_map._shard_slice)."""
        if ".linear_attn.in_proj." not in param_name:
            return None
        return self.recurrent_layers()[0].shard_sizes()  # type: ignore[operator]

    def checkpoint_sources(self, name: str) -> list[str] | None:
        """The output gate's rows come from q_proj's (model_loader._sources)."""
        if name.endswith(".self_attn.o_gate"):
            return [name.removesuffix("o_gate") + "q_proj.weight"]
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(expert_names(_checkpoint_weights(weights, self.config)))


def _unpack_qkvz_ba(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's per-key-head packed inputs as Qwen3.5's four: each key head's rows of
    in_proj_qkvz are [q dk, k dk, v g dv, z g dv] and of in_proj_ba [b g, a g] (g value heads
    a key head); Qwen3.5's hold all q, then all k, then all v (and z, b, a apart)."""
    s = config.linear_attn
    assert s is not None
    g = s.num_value_heads // s.num_key_heads
    dk, gv = s.key_head_dim, g * s.value_head_dim
    heads = torch.arange(s.num_key_heads)[:, None]

    def part(per: int, start: int, width: int) -> torch.Tensor:
        return (heads * per + start + torch.arange(width)).reshape(-1)

    per = 2 * dk + 2 * gv
    qkv = torch.cat([part(per, 0, dk), part(per, dk, dk), part(per, 2 * dk, gv)])
    split = {".in_proj_qkvz.": (("in_proj_qkv", qkv), ("in_proj_z", part(per, 2 * dk + gv, gv))),
             ".in_proj_ba.": (("in_proj_b", part(2 * g, 0, g)), ("in_proj_a", part(2 * g, g, g)))}
    for name, w in weights:
        packed = next((k for k in split if k in name), None)
        if packed is None:
            yield name, w
            continue
        for new, index in split[packed]:
            yield name.replace(packed, f".{new}."), select_rows(w, index)


def _checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3.5's tensors as the layers hold them: (1 + w) norms folded (the linear layers'
    output norm is plain w), each head's q rows and gate rows of q_proj apart (q_proj and
    o_gate); the multi-token
    prediction head (`mtp.`), which Loom does not run, left out."""
    D, heads = config.head_dim, config.num_attention_heads
    first = (torch.arange(heads)[:, None] * 2 * D + torch.arange(D)).reshape(-1)
    for name, w in weights:
        if name.startswith("mtp."):
            continue
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w.float() + 1.0
        elif config.attn_output_gate and ".self_attn.q_proj." in name:
            for part, index in (("q_proj", first), ("o_gate", first + D)):
                yield name.replace(".q_proj.", f".{part}."), select_rows(w, index)
            continue
        yield name, w


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next (80B-A3B): Qwen3.5-MoE's layers (some MLPs dense, by decoder_sparse_step and
    mlp_only_layers) whose linear layers' inputs come packed per key head: in_proj_qkvz rows
    [q, k, v, z] and in_proj_ba rows [b, a] for each key head's group, split at load into
    Qwen3.5's in_proj_qkv / _z / _b / _a (llama.cpp's converter already splits qkvz)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_unpack_qkvz_ba(weights, self.config))


class Lfm2ForCausalLM(HybridForCausalLM):
    """LFM2 and its mixtures of experts (LFM2-8B-A1B: the first layers' MLPs dense, the others
    mixtures whose router scores by sigmoid and picks with a learned bias)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(expert_names(_lfm2_weights(weights)))



# LFM2's Hugging Face names -> Llama's (a layer's norms, attention's q/k norms and output, the
# MLP's (and its experts') w1 / w3 / w2) and the final norm's
_LFM2_NAMES = {
    ".operator_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".self_attn.out_proj.": ".self_attn.o_proj.", ".feed_forward.": ".mlp.",
    ".mlp.w1.": ".mlp.gate_proj.", ".mlp.w3.": ".mlp.up_proj.", ".mlp.w2.": ".mlp.down_proj.",
}
_LFM2_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LFM2_EXPERT = re.compile(r"(\.mlp\.experts\.\d+)\.(w1|w3|w2)\.")


def _lfm2_weights(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """LFM2's tensors under Llama's names."""
    for name, w in weights:
        if name == "model.embedding_norm.weight":
            name = "model.norm.weight"
        for old, new in _LFM2_NAMES.items():
            name = name.replace(old, new)
        name = _LFM2_EXPERT.sub(lambda m: f"{m[1]}.{_LFM2_MLP[m[2]]}.", name)
        yield name, w


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """Granite 4.0 (and Granite 3's mixtures of experts, GraniteMoe / GraniteMoeShared): Mamba2
    in most layers of the -H models, attention in the others (without positions where the
    config's position_embedding_type is not "rope"), Granite's multipliers (folded as
    LlamaModel says), a dense MLP (`shared_mlp`) in every layer, or a mixture of experts with
    that MLP beside it as an ungated shared expert (which the one-call C stack does not run:
    those run layer by layer)."""


    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(expert_names(_granite_weights(weights, self.config)))


def _granite_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite's tensors under Loom's names: shared_mlp's input_linear ([gate; up] rows) and
    output_linear as the layer's MLP, or its mixture's shared expert; the mixture's router
    (router.layer) as mlp.gate, its stacked experts' input_linear / output_linear as
    gate_up_proj / down_proj (split by expert_names)."""
    mlp = ".mlp.shared_expert." if config.num_experts else ".mlp."
    names = {".shared_mlp.input_linear.": f"{mlp}gate_up_proj.",
             ".shared_mlp.output_linear.": f"{mlp}down_proj.",
             ".block_sparse_moe.router.layer.": ".mlp.gate.",
             ".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
             ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj"}
    for name, w in weights:
        for old, new in names.items():
            name = name.replace(old, new)
        yield name, w
