"""Frozen configuration objects, validated without I/O.

Reading a Hugging Face config or GGUF metadata happens in `loom.loader`; values found at run time
(number of KV blocks, eos ids) live in their own objects, never patched in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value is inconsistent or unsupported."""


@dataclass(frozen=True)
class LinearAttnConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5, Qwen3-Next): a causal depthwise
    convolution over q, k, v, then linear attention whose [key_head_dim, value_head_dim]
    state per value head is decayed and corrected by each token (loom/layers/gated_delta.py)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # value heads ordered tiled (head j reads key head j % num_key_heads: llama.cpp's
    # converter's order), not grouped (j // (num_value_heads / num_key_heads): Hugging Face's)
    tiled_heads: bool = False

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                     "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: linear attention {name} must be a positive "
                                  f"integer, got {value!r}")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(f"model config: linear_num_value_heads ({self.num_value_heads}) "
                              f"is not a multiple of linear_num_key_heads ({self.num_key_heads})")


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba2 layers of a hybrid model (Granite 4.0-H, Nemotron-H): a causal depthwise
    convolution over x, B and C, then a selective state space whose [head_dim, state_size]
    state per head decays by exp(dt A) a token (loom/layers/mamba2.py)."""

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int  # B and C are shared by the heads of a group
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj's and out_proj's
    # the gated output norm's groups (its RMS over d_inner / norm_groups channels each)
    norm_groups: int = 1
    time_step_min: float = 0.0  # dt = softplus(.) clamped to [min, max]
    time_step_max: float = float("inf")

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel",
                     "norm_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: mamba {name} must be a positive integer, "
                                  f"got {value!r}")
        if self.num_heads % self.num_groups:
            raise ConfigError(f"model config: mamba heads ({self.num_heads}) are not a multiple "
                              f"of its groups ({self.num_groups})")
        if self.inner_size % self.norm_groups:
            raise ConfigError(f"model config: mamba inner size ({self.inner_size}) is not a "
                              f"multiple of its norm groups ({self.norm_groups})")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # registry key, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # Dims of each head RoPE rotates (partial rotary: Phi-4-mini's 0.75 of them); 0: all
    rotary_dim: int = 0
    # The checkpoint rotates pairs (2i, 2i + 1) (GLM's), not (i, i + rotary_dim / 2)
    rotary_interleaved: bool = False
    nope_layers: tuple[int, ...] = ()  # layers without rotary positions (SmolLM3's every 4th)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    qk_norm_full: bool = False  # with qk_norm: over all of q's and all of k's heads (OLMo 2)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention kind ("sliding_attention" / "full_attention"); empty: every layer
    # uses `sliding_window` (Mistral). Gemma 2/3 interleave the two.
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma)
    attn_logit_softcapping: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the output logits (Gemma 2)
    # Granite's multipliers: embeddings x embedding_multiplier, each attention / MLP output x
    # residual_multiplier before its residual add, attention scores x attention_multiplier
    # (None: head_dim ** -0.5), logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Mixture of experts (0 experts: a dense MLP in every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    # the shared expert's output behind a sigmoid gate (Qwen's), else added as it is (Granite's)
    shared_expert_gated: bool = True
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers with experts; empty: all when num_experts
    # The router: "softmax" over experts, or "sigmoid" scores (LFM2-MoE's: experts picked by
    # score + a learned per-expert bias, weighted by their scores, renormalised with a 1e-6
    # floor), the picked weights times routed_scaling_factor
    moe_router: str = "softmax"
    routed_scaling_factor: float = 1.0
    # group-limited routing (Nemotron-H's, DeepSeek V3's): the experts in `moe_groups` equal
    # groups, each group scored by its best two experts' choice scores, the top-k picked
    # among the best `moe_topk_groups` groups' experts only
    moe_groups: int = 1
    moe_topk_groups: int = 1
    # Embeddings (LLM.embed, /v1/embeddings): "last" token's or "mean" of the hidden states.
    pooling: str = "last"
    # Hybrid models: the layers whose token mixer keeps a state per request instead of
    # attending over a KV cache, and that mixer: Qwen3.5's linear attention (`linear_attn`)
    # or LFM2's short convolution (`short_conv_width` > 0: its width, and a bias or not), or
    # Mamba2 (`mamba`: Granite 4.0-H's, Nemotron-H's).
    linear_layers: tuple[int, ...] = ()
    linear_attn: LinearAttnConfig | None = None
    short_conv_width: int = 0
    short_conv_bias: bool = False
    mamba: MambaConfig | None = None
    # layers that are an MLP (or a mixture of experts) alone, no token mixer before it: with
    # one norm a layer, as Nemotron-H's (its attention and Mamba2 layers have no MLP)
    mlp_only_layers: tuple[int, ...] = ()
    # attention's output times sigmoid(x W_gate), W_gate's rows beside q's (Qwen3.5)
    attn_output_gate: bool = False

    @property
    def residual_norm_eps(self) -> float:
        """The eps of the norms on the residual stream once Granite's residual multiplier m is
        folded in (loom.models.llama.LlamaModel): the model carries h / m instead of h, and
        RMSNorm(h; eps) = RMSNorm(h / m; eps / m^2) exactly."""
        return self.rms_norm_eps / self.residual_multiplier**2

    @property
    def num_kv_layers(self) -> int:
        """The layers that attend over a KV cache (all but a hybrid's linear layers and
        MLP-only layers)."""
        return self.num_hidden_layers - len(self.linear_layers) - len(self.mlp_only_layers)

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones, as Hugging Face's partial rotary)."""
        return self.rotary_dim or self.head_dim

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model config: {name} must be positive, got "
                                  f"{getattr(self, name)!r}")
        if self.residual_multiplier != 1.0 and self.qk_norm:  # (residual_norm_eps's folding)
            raise ConfigError("model config: residual_multiplier with q/k norms is not supported")
        if any(not 0 <= i < self.num_hidden_layers for i in self.nope_layers):
            raise ConfigError(f"model config: nope_layers {self.nope_layers} outside the "
                              f"{self.num_hidden_layers} layers")
        if self.rotary_dim and not (0 < self.rotary_dim <= self.head_dim
                                    and self.rotary_dim % 2 == 0):
            raise ConfigError(f"model config: rotary_dim must be even and in 1..head_dim "
                              f"({self.head_dim}), got {self.rotary_dim}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"model config: unsupported hidden_act {self.hidden_act!r}; "
                              f"supported: {', '.join(HIDDEN_ACTS)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"model config: {len(self.layer_types)} layer_types for "
                                  f"{self.num_hidden_layers} layers")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ConfigError(f"model config: unsupported layer types {sorted(unknown)}; "
                                  f"supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError("model config: sliding_attention layers need a sliding_window")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) "
                              f"must be in 1..num_experts ({self.num_experts})")
        mixers = ((self.linear_attn is not None) + (self.short_conv_width > 0)
                  + (self.mamba is not None))
        if self.linear_layers and (
                mixers != 1 or self.num_kv_layers <= 0
                or set(self.linear_layers) & set(self.mlp_only_layers)
                or any(not 0 <= i < self.num_hidden_layers for i in self.linear_layers)):
            raise ConfigError(f"model config: linear_layers {self.linear_layers} need one "
                              f"mixer and at least one of the {self.num_hidden_layers} layers "
                              "to attend")
        if self.moe_groups < 1 or self.num_experts % self.moe_groups or not (
                1 <= self.moe_topk_groups <= self.moe_groups) or (
                self.moe_groups > 1 and self.moe_router != "sigmoid"):
            raise ConfigError(f"model config: {self.num_experts} experts in {self.moe_groups} "
                              f"groups, the best {self.moe_topk_groups} of them, is not a "
                              "valid expert grouping")
        if self.moe_router not in ("softmax", "sigmoid"):
            raise ConfigError(f"model config: unsupported expert router {self.moe_router!r}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"model config: unsupported pooling {self.pooling!r}; "
                              f"supported: {', '.join(POOLINGS)}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and (not self.moe_layers or layer in self.moe_layers)


# (relu2: relu(x)^2 in an ungated MLP, Nemotron-H's)
HIDDEN_ACTS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh", "relu2")
LAYER_TYPES = ("sliding_attention", "full_attention")


def interleaved_layer_types(num_layers: int, period: int,
                            other: str = "sliding_attention") -> tuple[str, ...]:
    """`layer_types` where every `period`-th layer is global and the others `other` (what
    Gemma 2 and 3 configs without a per-layer list mean: every 2nd, every 6th sliding; Qwen3.5's
    full_attention_interval: every 4th, the others linear attention)."""
    return tuple("full_attention" if (i + 1) % period == 0 else other for i in range(num_layers))


POOLINGS = ("last", "mean")


# --kv-cache-dtype: auto is the model's dtype (loom.worker.kv_cache maps the names to torch's;
# int8 holds each head's K and V rows as 8-bit groups of 32 with an fp32 scale and minimum;
# fp8, CUDA only, e4m3 values with a scale per KV head).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # How many bytes the KV cache may take; None: a fraction of free memory.
    kv_cache_memory: int | None = None
    memory_fraction: float = 0.5
    # Exact block count, overriding the memory rules (tests).
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("num_gpu_blocks_override must be at least 2 (block 0 is reserved)")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: str = "fcfs"  # or "priority" (loom/core/scheduler.py)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                              f", got {self.policy!r}")
