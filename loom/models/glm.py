"""GLM-4 (THUDM / Z.ai's dense GLM-4 9B and 32B, `Glm4ForCausalLM`): a Llama whose layers also
norm attention's output and the MLP's before each residual add (post_self_attn_layernorm,
post_mlp_layernorm), with a partial rotary over interleaved pairs (ModelConfig's rotary_dim and
rotary_interleaved; the rows are reordered at load, loom.models.llama.partial_rotary_order).
The older `GlmForCausalLM` (glm-4-9b-chat-hf) is the same without the two norms: a plain
LlamaForCausalLM with that rotary."""

from __future__ import annotations

from loom.config import ModelConfig
from loom.layers.norm import RMSNorm
from loom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Glm4DecoderLayer(LlamaDecoderLayer):
    attn_out_norm_name = "post_self_attn_layernorm"
    mlp_out_norm_name = "post_mlp_layernorm"

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        h, eps = config.hidden_size, config.residual_norm_eps
        self.post_self_attn_layernorm = RMSNorm(h, eps)
        self.post_mlp_layernorm = RMSNorm(h, eps)


class Glm4Model(LlamaModel):
    layer_cls = Glm4DecoderLayer


class Glm4ForCausalLM(LlamaForCausalLM):
    model_cls = Glm4Model
