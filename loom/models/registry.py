"""Architecture registry: the checkpoint's declared architecture picks the model class."""

from __future__ import annotations

from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.models.gemma import Gemma1ForCausalLM, GemmaForCausalLM
from loom.models.glm import Glm4ForCausalLM
from loom.models.llama import LlamaForCausalLM
from loom.models.moe import MoeForCausalLM
from loom.models.nemotron_h import NemotronHForCausalLM
from loom.models.olmo import Olmo2ForCausalLM
from loom.models.hybrid import (
    GraniteMoeHybridForCausalLM, Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3NextForCausalLM,
)

# HF `architectures` names; GGUF `general.architecture` values are mapped in loader/gguf.py.
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Ministral3ForCausalLM": LlamaForCausalLM,  # YaRN; context capped (hf.query_scaled_context)
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": Gemma1ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # q/k/v and gate/up come fused in the checkpoint
    "SmolLM3ForCausalLM": LlamaForCausalLM,  # NoPE layers (ModelConfig.nope_layers)
    "GraniteForCausalLM": LlamaForCausalLM,  # its multipliers (ModelConfig), folded
    "GlmForCausalLM": LlamaForCausalLM,  # interleaved partial rotary
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,  # interleaved rotary pairs over the whole head
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    # OLMo 2's layer (norms after attention and the MLP) with per-head q/k norms, and with a
    # sliding window its 3:1 sliding / full layers, the full ones without RoPE
    "Exaone4ForCausalLM": Olmo2ForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    # Gated DeltaNet linear attention in three layers of four, gated attention in the rest
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,  # (its MLPs mixtures of experts)
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,  # (the linear layers' inputs packed)
    # short gated convolutions in most layers, attention with q/k norms in the others
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2ForCausalLM,  # (mixtures of experts after dense layers)
    # Mamba2 in most layers of Granite 4.0-H, attention without positions in the others; the
    # same class runs Granite 4.0's dense transformers and Granite 3's mixtures of experts
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeHybridForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeHybridForCausalLM,
    # one block a layer: Mamba2, attention without positions, or a relu^2 MLP or its experts
    "NemotronHForCausalLM": NemotronHForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return _MODELS[config.architecture]
    except KeyError:
        raise ConfigError(
            f"unsupported architecture {config.architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        ) from None
