"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) on a flattened token batch.

Parameter names follow Hugging Face; q/k/v are packed into `qkv_proj` and gate/up into
`gate_up_proj` at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loom.attention.forward_context import get_forward_context
from loom.attention.layer import Attention
from loom.config import ModelConfig
from loom.layers.embedding import VocabEmbedding
from loom.layers.linear import Linear
from loom.layers.norm import RMSNorm
from loom.kernels import cpu_ops
from loom.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from loom.models import q8_decoder
from loom.models.weight_map import load_packed_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        scalar = config.query_pre_attn_scalar
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, config.layer_window(layer),
            scale=None if scalar is None else scalar**-0.5, softcap=config.attn_logit_softcapping,
        )

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if rope.fused and not self.qk_norm:
            # One C call rotates q and k in place and writes k, v to the cache.
            md = get_forward_context().attn_metadata
            cpu_ops.rope_write_kv_(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.table,
                rope.positions, md.slot_mapping, self.attn.kv_cache,
            )
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            out = self.attn(q)  # [num_tokens, num_heads, head_dim]
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            qk = torch.cat([q, k], dim=1)
        else:  # q and k heads side by side in qkv: one rotation for both
            qk = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
        qk = apply_rotary(qk, *rope.cos_sin())
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self.gelu = config.hidden_act.startswith("gelu")  # gelu_pytorch_tanh (Gemma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if cpu_ops.usable(gate_up) and gate_up.is_contiguous():
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    rope_index = 0  # which of the model's `ropes` this layer's attention rotates with

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next layer's
        norm adds the two (fused on the CPU), as Hugging Face's x + mlp(norm(x)) does. With
        `keep` (row indices), every row's K and V go to the cache but only those rows go on
        past attention: both outputs are theirs alone."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        x = self.self_attn(rope, x)
        if keep is not None:
            x, residual = x[keep], residual[keep]
            if not len(keep):
                return x, residual
        return self.mlp_block(x, residual)

    def mlp_block(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output and the residual stream -> (the MLP's output, the residual stream
        before it)."""
        x, residual = self.post_attention_layernorm.add_norm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.stack: q8_decoder.Q8Decoder | bool | None = None  # the one-call C stack, if any

    def c_stack(self) -> q8_decoder.Q8Decoder | None:
        """The one-call C stack where it runs this step (int8 on the CPU), else None."""
        if self.stack is None:  # decided on the first step, after any quantization
            self.stack = q8_decoder.Q8Decoder(self) if q8_decoder.eligible(self) else False
        return self.stack if self.stack and self.stack.usable() else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: np.ndarray | None = None
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final-normed hidden states [num_tokens, hidden],
        or with `keep` (ascending int64 rows) those rows' alone: the last layer's MLP runs on
        them only (llama.cpp's output rows; the other rows' K and V are in the cache by then)."""
        stack = self.c_stack()
        if stack is not None:  # every layer in one C call
            return stack.forward(input_ids, positions, rows=keep, only_rows=keep is not None)[0]
        x, residual = self.run_layers(self.embed(input_ids), None, positions, keep)
        if not x.shape[0]:
            return x
        return self.norm.add_norm(x, residual)[0]

    def run_layers(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        keep: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """self.layers on x [num_tokens, hidden] and the residual stream (None before the first
        layer): (the last layer's MLP output, the residual stream before it), `keep`'s rows
        alone past the last layer's attention where given (LlamaDecoderLayer.forward)."""
        ropes = self.ropes(positions, fused=cpu_ops.usable(x))  # shared by every layer
        last = len(self.layers) - 1
        rows = None if keep is None else torch.from_numpy(keep).to(x.device)
        for i, layer in enumerate(self.layers):
            x, residual = layer(ropes[layer.rope_index], x, residual,
                                rows if i == last else None)
        return x, residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [num_tokens] -> the first layer's input [num_tokens, hidden]."""
        return self.embed_tokens(input_ids)

    def ropes(self, positions: torch.Tensor, fused: bool) -> tuple[Rope, ...]:
        """The step's rotations, indexed by the layers' `rope_index`."""
        return (Rope(self.rotary_emb, positions, fused),)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (packed parameter fragment, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    model_cls: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        if self.c_stack_refusal() is not None:
            self.model.stack = False  # never built: the model runs layer by layer
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [n, vocab]

    def forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: np.ndarray,
        only_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward, then compute_logits of hidden `rows` (ascending int64 indices; logits None
        when there are none): the output projection runs in the C stack's call where that runs
        (the same bits, without Python between the two). only_rows: the hidden states returned
        are those rows' alone, and the last layer's MLP skips the others (LlamaModel.forward's
        `keep`); else every row's."""
        stack = self.model.c_stack()
        if stack is None:
            hidden = self.model(input_ids, positions, rows if only_rows else None)
            logits = None
        else:
            hidden, logits = stack.forward(input_ids, positions, self.lm_head, rows, only_rows)
        if logits is None and len(rows):
            logits = self.compute_logits(
                hidden if only_rows else hidden[torch.from_numpy(rows).to(hidden.device)])
        return hidden, logits

    def c_stack_refusal(self) -> str | None:
        """Why the one-call C decoder stack (int8) cannot run this model, or None if it can: the
        one place that says which models it runs (a refused model never builds it; the loader
        logs the reason)."""
        if self.config.qk_norm:
            return f"{self.config.architecture} with q/k norms"
        return None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def init_buffers(self, device: torch.device) -> None:
        self.model.rotary_emb.build_cache(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        load_packed_weights(self, weights, self.packed_modules, skip=skip)
