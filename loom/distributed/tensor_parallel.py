"""Slice a loaded Llama-family model (Llama, Mistral, Qwen2/3, Gemma 2/3) for one TP rank.

Attention: rank r keeps query heads [r*H/N, (r+1)*H/N) and their KV heads (KV/N each; when
KV < N each rank keeps the one KV head its query heads read, so KV heads are replicated), the
matching rows of qkv_proj (column parallel) and columns of o_proj (row parallel: one
all-reduce). MLP: rows of gate and of up (column parallel), columns of down_proj (row
parallel: one all-reduce). Embedding and LM head: vocabulary slices (loom.layers.parallel).
Norms and rotary tables are replicated. The model is loaded whole on each rank, then sliced:
peak memory at load is the whole model's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.layers.parallel import (
    ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
)
from loom.models.llama import LlamaAttention, LlamaMLP


def check_shardable(model: nn.Module, config: ModelConfig, world: int) -> None:
    """ConfigError unless `model` can be split over `world` ranks."""
    if config.num_experts:
        raise ConfigError("--tensor-parallel-size > 1 does not run mixture-of-experts models "
                          f"yet ({config.architecture})")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % world:
        raise ConfigError(f"--tensor-parallel-size {world} must divide the number of attention "
                          f"heads ({heads})")
    if kv % world and world % kv:
        raise ConfigError(f"--tensor-parallel-size {world} and the number of KV heads ({kv}) "
                          "must divide one another")
    for name, module in model.named_modules():
        if isinstance(module, (LlamaAttention, LlamaMLP)):
            for proj_name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                proj = getattr(module, proj_name, None)
                if proj is None:
                    continue
                weight = getattr(proj, "weight", None)
                if not (isinstance(proj, nn.Linear) and isinstance(weight, torch.Tensor)
                        and weight.dtype.is_floating_point):
                    raise ConfigError(
                        "--tensor-parallel-size > 1 runs unquantized weights only (the int8 C "
                        "stack and quantized linear layers are single-process): add "
                        f"--quantization none ({name} is {type(proj).__name__})")


def rank_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank's attention and KV cache have."""
    return replace(config, num_attention_heads=config.num_attention_heads // world,
                   num_key_value_heads=max(1, config.num_key_value_heads // world))


def shard_model(model: nn.Module, config: ModelConfig, rank: int, world: int,
                group=None) -> ModelConfig:
    """Replace `model`'s layers by rank `rank`'s slices in place; returns rank_config."""
    check_shardable(model, config, world)
    for module in list(model.modules()):
        if isinstance(module, LlamaAttention):
            _shard_attention(module, rank, world, group)
        elif isinstance(module, LlamaMLP):
            _shard_mlp(module, rank, world, group)
    inner = model.model  # type: ignore[attr-defined]
    full_embed = inner.embed_tokens.weight.data
    tied = model.lm_head.weight is inner.embed_tokens.weight  # type: ignore[attr-defined]
    full_head = full_embed if tied else model.lm_head.weight.data  # type: ignore[attr-defined]
    inner.embed_tokens = VocabParallelEmbedding(full_embed, rank, world, group)
    head_weight = (inner.embed_tokens.weight if tied else
                   VocabParallelEmbedding(full_head, rank, world, group).weight)
    model.lm_head = ParallelLMHead(head_weight, config.vocab_size, world, group)
    if hasattr(inner, "stack"):
        inner.stack = False  # the one-call C stack is single-process
    return rank_config(config, world)


def _shard_attention(attn: LlamaAttention, rank: int, world: int, group) -> None:
    hd, heads, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    local_heads = heads // world
    local_kv = max(1, kv // world)
    first_kv = rank * kv // world  # the KV heads rank's query heads read
    q0 = rank * local_heads * hd
    k0 = heads * hd + first_kv * hd
    v0 = heads * hd + kv * hd + first_kv * hd
    rows = torch.cat([torch.arange(q0, q0 + local_heads * hd),
                      torch.arange(k0, k0 + local_kv * hd),
                      torch.arange(v0, v0 + local_kv * hd)])
    qkv = attn.qkv_proj
    attn.qkv_proj = ColumnParallelLinear(qkv.weight.data[rows],
                                         None if qkv.bias is None else qkv.bias.data[rows])
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(o.weight.data[:, q0:q0 + local_heads * hd],
                                    None if o.bias is None else o.bias.data, group)
    attn.num_heads = attn.attn.num_heads = local_heads
    attn.num_kv_heads = attn.attn.num_kv_heads = local_kv
    attn.q_size = local_heads * hd
    attn.kv_size = local_kv * hd


def _shard_mlp(mlp: LlamaMLP, rank: int, world: int, group) -> None:
    inter = mlp.intermediate_size
    if inter % world:
        raise ConfigError(f"--tensor-parallel-size {world} must divide the MLP width ({inter})")
    local = inter // world
    lo, hi = rank * local, (rank + 1) * local
    w = mlp.gate_up_proj.weight.data  # [2 * inter, hidden]: gate rows, then up rows
    mlp.gate_up_proj = ColumnParallelLinear(torch.cat([w[lo:hi], w[inter + lo:inter + hi]]),
                                            None)
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data[:, lo:hi], None, group)
    mlp.intermediate_size = local
