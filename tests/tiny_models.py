"""Tiny random-weight Hugging Face models, written to a folder as real checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def _configs() -> dict[str, object]:
    from transformers import (
        Ernie4_5Config, Exaone4Config, Gemma2Config, GemmaConfig, Gemma3TextConfig, Glm4Config, GlmConfig, GraniteConfig,
        LlamaConfig, Ministral3Config, MistralConfig,
        MixtralConfig, Olmo2Config, Phi3Config,
        Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config,
    )
    from transformers.models.granitemoe import GraniteMoeConfig
    from transformers.models.granitemoehybrid import GraniteMoeHybridConfig
    from transformers.models.lfm2 import Lfm2Config
    from transformers.models.nemotron_h import NemotronHConfig
    from transformers.models.lfm2_moe import Lfm2MoeConfig
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import Qwen3NextConfig

    return {
        "llama": LlamaConfig(**TINY, tie_word_embeddings=False),
        "llama-tied": LlamaConfig(**TINY, tie_word_embeddings=True),
        "llama3-rope": LlamaConfig(
            **TINY,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "mistral": MistralConfig(**TINY, sliding_window=12),
        "qwen2": Qwen2Config(**TINY, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
        # Gemma: a window of 8 positions on the sliding layers, the full context on the others
        "gemma3": Gemma3TextConfig(
            **TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "gemma": GemmaConfig(**TINY, head_dim=16),  # Gemma 1
        "gemma2": Gemma2Config(
            **TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        ),
        # Mixtures of 4 experts, 2 a token; the second layer of qwen3-moe dense
        "qwen3-moe": Qwen3MoeConfig(
            **{**TINY, "num_hidden_layers": 3}, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        ),
        "qwen2-moe": Qwen2MoeConfig(
            **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False,
        ),
        "mixtral": MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
        # LongRoPE: the prompts stay below original_max_position_embeddings (short factors)
        "phi3": Phi3Config(
            **TINY, original_max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
                          "long_factor": [2.0 + i for i in range(8)]},
        ),
        # Phi-4-mini's shape: RoPE on 12 of each head's 16 dims (LongRoPE's factors for those)
        "phi3-partial": Phi3Config(
            **TINY, original_max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
            partial_rotary_factor=0.75,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(6)],
                          "long_factor": [2.0 + i for i in range(6)]},
        ),
        # YaRN past an original context of 16 positions (the prompts and replies run to ~60)
        "qwen3-yarn": Qwen3Config(
            **TINY, head_dim=32, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16},
        ),
        # SmolLM3: its 4th layer without RoPE (NoPE)
        "smollm3": SmolLM3Config(**{**TINY, "num_hidden_layers": 4}, tie_word_embeddings=True,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
        # Granite's multipliers, far from 1 so that each one shows
        "granite": GraniteConfig(**TINY, embedding_multiplier=12.0, residual_multiplier=0.22,
                                 attention_multiplier=0.0625, logits_scaling=8.0,
                                 tie_word_embeddings=True),
        # GLM: RoPE on half of each head's dims, interleaved pairs; GLM-4's sandwich norms
        "glm4": Glm4Config(**TINY, head_dim=16, pad_token_id=0, eos_token_id=2),
        "glm": GlmConfig(**TINY, head_dim=16, pad_token_id=0, eos_token_id=2),
        # ERNIE 4.5: GLM's interleaved pairs over the whole head
        # q/k norms over all heads, norms after attention and the MLP, none before
        "olmo2": Olmo2Config(**TINY, pad_token_id=0, eos_token_id=2),
        # YaRN with mscale / mscale_all_dim and Llama 4's query scaling past 64 positions (the
        # context Loom runs it to: the prompts stay below)
        "ministral3": Ministral3Config(**TINY, pad_token_id=0, eos_token_id=2, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
        # OLMo 2's norms, per-head q/k norms, a sliding layer and a full one without RoPE
        "exaone4": Exaone4Config(**TINY, sliding_window=8, pad_token_id=0, eos_token_id=2,
                                 layer_types=["sliding_attention", "full_attention"]),
        # Qwen3.5: Gated DeltaNet in the first and last layers (two value heads a key head,
        # key and value heads of different widths), gated attention with a quarter-head
        # rotary between
        "qwen3_5": Qwen3_5TextConfig(
            **{**TINY, "num_hidden_layers": 3}, head_dim=16, pad_token_id=0, eos_token_id=2,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False),
        # Qwen3.5's mixture of experts: 4 experts, 2 a token, a shared expert, in every layer
        "qwen3_5-moe": Qwen3_5MoeTextConfig(
            **{**{k: v for k, v in TINY.items() if k != "intermediate_size"},
               "num_hidden_layers": 3}, head_dim=16, pad_token_id=0, eos_token_id=2,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48),
        # Qwen3-Next: Qwen3.5-MoE's layers, the second MLP dense, inputs packed per key head
        "qwen3-next": Qwen3NextConfig(
            **{**TINY, "num_hidden_layers": 3}, head_dim=16, pad_token_id=0, eos_token_id=2,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
        # LFM2: short convolutions (with a bias) in the first and last layers, attention with
        # q/k norms between; the MLP's width adjusted as LFM2's (128 -> 2/3, rounded up to 32)
        "lfm2": Lfm2Config(**{**TINY, "num_hidden_layers": 3}, layer_types=[
            "conv", "full_attention", "conv"], conv_bias=True, block_multiple_of=32,
            block_ffn_dim_multiplier=1.0, pad_token_id=0, eos_token_id=2),
        # LFM2's mixture of experts: a dense first layer, then 4 experts, 2 a token, routed by
        # sigmoid scores and a per-expert bias
        "lfm2-moe": Lfm2MoeConfig(
            **{**TINY, "num_hidden_layers": 3, "intermediate_size": 96},
            layer_types=["conv", "full_attention", "conv"], num_dense_layers=1,
            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            routed_scaling_factor=1.5, pad_token_id=0, eos_token_id=2),
        # Granite 4.0-H: Mamba2 (8 heads in 2 groups) in the first and last layers, attention
        # without positions between, Granite's multipliers, a dense MLP (shared_mlp)
        "granite4-h": GraniteMoeHybridConfig(
            **{**TINY, "num_hidden_layers": 3}, layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
            num_local_experts=0, shared_intermediate_size=96, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.0078, logits_scaling=6.0,
            position_embedding_type="nope", pad_token_id=0, eos_token_id=2),
        # Granite 3's mixtures of experts: 4 experts, 2 a token, in every layer
        "granite-moe": GraniteMoeConfig(
            **{**TINY, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078,
            logits_scaling=6.0, pad_token_id=0, eos_token_id=2),
        # Granite 4.0's dense transformer (micro): the same class, attention in every layer
        "granite4": GraniteMoeHybridConfig(
            **TINY, layer_types=["attention", "attention"], num_local_experts=0,
            shared_intermediate_size=96, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.0078, logits_scaling=6.0, position_embedding_type="rope",
            pad_token_id=0, eos_token_id=2),
        # its mixture of experts (4, 2 a token) beside the shared MLP, RoPE in attention
        "granite4-h-moe": GraniteMoeHybridConfig(
            **{**TINY, "num_hidden_layers": 3, "intermediate_size": 32},
            layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=32,
            mamba_n_groups=1, mamba_d_state=16, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=48, embedding_multiplier=4.0, residual_multiplier=0.5,
            attention_multiplier=0.1, logits_scaling=2.0, position_embedding_type="rope",
            pad_token_id=0, eos_token_id=2),
        # Nemotron-H: one block a layer, Mamba2 (8 heads in 2 groups), relu^2 MLPs, attention
        # without positions
        "nemotron-h": NemotronHConfig(
            vocab_size=256, hidden_size=64, hybrid_override_pattern="M-*M-",
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
            max_position_embeddings=256, pad_token_id=0, eos_token_id=2),
        # Nemotron 3's mixtures: 8 experts in 2 groups, 2 a token from the best group, sigmoid
        # scores and a bias, a shared expert
        "nemotron-h-moe": NemotronHConfig(
            vocab_size=256, hidden_size=64, hybrid_override_pattern="ME*ME",
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, max_position_embeddings=256, pad_token_id=0,
            eos_token_id=2),
        "ernie4_5": Ernie4_5Config(**TINY, head_dim=16, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2),
    }


ARCHS = ["llama", "llama-tied", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma3", "gemma2",
         "qwen3-moe", "qwen2-moe", "mixtral", "phi3", "phi3-partial", "qwen3-yarn", "smollm3",
         "granite", "glm4", "glm", "ernie4_5", "olmo2", "exaone4", "ministral3", "gemma", "qwen3_5",
         "lfm2", "qwen3_5-moe", "qwen3-next", "lfm2-moe", "granite4-h", "granite4-h-moe",
         "granite4", "granite-moe", "nemotron-h", "nemotron-h-moe"]


def make_tiny_model(name: str, folder: Path, seed: int = 0, **overrides: int) -> Path:
    """Save a random-weight model `name` (see ARCHS) in fp32 safetensors under `folder`;
    `overrides` replace config fields (e.g. vocab_size=49152 to match a real tokenizer)."""
    from transformers import AutoModelForCausalLM

    config = _configs()[name]
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # widen the random init so logits are not all near zero
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08 if p.dim() > 1 else 0.1)
        for bname, b in model.named_buffers():  # (LFM2-MoE's router bias picks the experts)
            if bname.endswith(("expert_bias", "e_score_correction_bias")):
                b.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def smollm2_tokenizer():  # -> transformers' tokenizer
    """The packaged SmolLM2's tokenizer in transformers (to change, or to save beside a model)."""
    from loom.loader.resolve import resolve_model
    from loom.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_source(resolve_model(None)).hf


def make_tiny_chat_model(name: str, folder: Path, tokenizer=None, **overrides: int) -> Path:
    """make_tiny_model with a tokenizer saved beside it (SmolLM2's unless given) for an engine
    to load; `overrides` as make_tiny_model's (vocab_size=len(tokenizer) to use all of it)."""
    make_tiny_model(name, folder, **overrides)
    (tokenizer or smollm2_tokenizer()).save_pretrained(folder)
    return folder
