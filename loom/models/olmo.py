"""OLMo 2 (AI2's fully open models, `Olmo2ForCausalLM`; GGUF `olmo2`): a Llama whose layers norm
attention's output and the MLP's (post_attention_layernorm, post_feedforward_layernorm) instead
of their inputs, and whose q and k norms span all heads at once (ModelConfig.qk_norm_full).
EXAONE 4 (`Exaone4ForCausalLM`, GGUF `exaone4`) runs on the same layer with per-head q/k norms
and, with a sliding window, full layers without RoPE (its config: loader/hf.py)."""

from __future__ import annotations

from loom.config import ModelConfig
from loom.layers.norm import NoNorm, RMSNorm
from loom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Olmo2DecoderLayer(LlamaDecoderLayer):
    mlp_norm_name = "pre_mlp_norm"  # NoNorm: the residual add alone
    attn_out_norm_name = "post_attention_layernorm"
    mlp_out_norm_name = "post_feedforward_layernorm"

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.input_layernorm = NoNorm()
        self.pre_mlp_norm = NoNorm()
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.residual_norm_eps)


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
