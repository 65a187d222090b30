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
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"model config: unsupported hidden_act {self.hidden_act!r}")


# --kv-cache-dtype: auto is the model's dtype (loom.worker.kv_cache maps the names to torch's;
# int8 holds each head's K and V rows as 8-bit groups of 32 with an fp32 scale and minimum).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8")


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


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
