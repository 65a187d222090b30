"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3) on a flattened token
batch, and the layer every other architecture (gemma.py, moe.py) describes itself by.

Parameter names follow Hugging Face; q/k/v are packed into `qkv_proj` and gate/up into
`gate_up_proj` at load time. A layer's optional parts (q/k norms, norms on attention's and the
MLP's outputs, the activation, its rotary table) are what its class declares; the per-module
forward and the one-call C stack (q8_decoder.py, which reads `LlamaDecoderLayer.stack_parts`)
run the same description.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from loom.attention.forward_context import get_forward_context
from loom.attention.layer import Attention
from loom.config import ConfigError, ModelConfig
from loom.kernels import cpu_ops
from loom.layers.activation import act_and_mul, activation_of
from loom.layers.embedding import VocabEmbedding
from loom.layers.linear import Linear
from loom.layers.norm import NoNorm, RMSNorm, qk_norm_
from loom.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from loom.models import q8_decoder
from loom.models.weight_map import load_packed_weights, select_rows


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
        self.qk_norm_full = config.qk_norm_full  # over all heads at once (OLMo 2)
        if config.qk_norm:
            full = config.qk_norm_full
            self.q_norm = RMSNorm(self.q_size if full else self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if full else self.head_dim, config.rms_norm_eps)
        scalar = config.query_pre_attn_scalar
        scale = config.attention_multiplier if scalar is None else scalar**-0.5
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, config.layer_window(layer),
            scale=scale, softcap=config.attn_logit_softcapping,
        )

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(rope, x))

    def attend(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> the heads' outputs [num_tokens, num_heads * head_dim],
        before the output projection."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if rope.fused:
            if self.qk_norm:  # each q and k head normed in place (the C stack's kernel)
                qk_norm_(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm,
                         self.k_norm, self.qk_norm_full)
            # One C call rotates q and k in place and writes k, v to the cache.
            md = get_forward_context().attn_metadata
            cpu_ops.rope_write_kv_(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.table,
                rope.positions, md.slot_mapping, self.attn.kv_cache,
            )
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            out = self.attn(q)  # [num_tokens, num_heads, head_dim]
            return out.reshape(num_tokens, self.q_size)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q_heads, k_heads = (num_tokens, self.num_heads, -1), (num_tokens, self.num_kv_heads, -1)
            if self.qk_norm_full:  # all heads as one row, then split into heads
                q = self.q_norm(q.contiguous()).view(q_heads)
                k = self.k_norm(k.contiguous()).view(k_heads)
            else:
                q, k = self.q_norm(q.view(q_heads)), self.k_norm(k.view(k_heads))
            qk = torch.cat([q, k], dim=1)
        else:  # q and k heads side by side in qkv: one rotation for both
            qk = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
        qk = apply_rotary(qk, *rope.cos_sin())
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v)  # [num_tokens, num_heads, head_dim]
        return out.reshape(num_tokens, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self.activation = activation_of(config.hidden_act)  # loom.layers.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.activation))


class LlamaDecoderLayer(nn.Module):
    """input norm -> attention (q/k norms where the config has them) -> [attention-output norm]
    -> residual add + MLP norm -> MLP -> [MLP-output norm]. Which of the layer's Hugging Face
    norms plays each role is the class's (`*_norm_name`: None, the part is absent); a subclass
    describes another architecture's layer by naming its norms (GemmaDecoderLayer)."""

    rope_index = 0  # which of the model's `rotaries` this layer's attention rotates with
    mlp_norm_name = "post_attention_layernorm"
    attn_out_norm_name: str | None = None
    mlp_out_norm_name: str | None = None

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        if layer in config.nope_layers:  # LlamaModel's second table: no rotation at all
            self.rope_index = 1
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.residual_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.residual_norm_eps)

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
        x = self.mix(rope, x)
        if keep is not None:
            x, residual = x[keep], residual[keep]
            if not len(keep):
                return x, residual
        return self.mlp_block(x, residual)

    def mix(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        """The token mixer on the normed input: attention (a hybrid's linear layers: their
        linear attention)."""
        return self.self_attn(rope, x)

    def _norm(self, name: str | None) -> RMSNorm | None:
        return None if name is None else getattr(self, name)

    def mlp_block(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output and the residual stream -> (the MLP's output, the residual stream
        before it)."""
        attn_out_norm, mlp_out_norm = map(self._norm, (self.attn_out_norm_name,
                                                       self.mlp_out_norm_name))
        if attn_out_norm is not None:
            x = attn_out_norm(x)
        x, residual = self._norm(self.mlp_norm_name).add_norm(x, residual)
        x = self.mlp(x)
        return (x if mlp_out_norm is None else mlp_out_norm(x)), residual

    def stack_parts(self) -> dict[str, object]:
        """What this layer is, for the C stack (q8_decoder.LayerQ8): its norms by role (None:
        absent), linears, attention and activation; gate_up and down None where the MLP is not
        a dense gated one (MoeDecoderLayer then names its mixture of experts, `moe`)."""
        a = self.self_attn
        dense = isinstance(self.mlp, LlamaMLP)
        return dict(
            in_norm=_weighted(self.input_layernorm),
            mlp_norm=_weighted(self._norm(self.mlp_norm_name)),
            q_norm=a.q_norm if a.qk_norm else None, k_norm=a.k_norm if a.qk_norm else None,
            attn_out_norm=self._norm(self.attn_out_norm_name),
            mlp_out_norm=self._norm(self.mlp_out_norm_name),
            qk_norm_full=a.qk_norm_full,
            qkv=a.qkv_proj, o=a.o_proj, attn=a.attn, rope_index=self.rope_index,
            gate_up=self.mlp.gate_up_proj if dense else None,
            down=self.mlp.down_proj if dense else None,
            activation=self.mlp.activation if dense else None,
        )


def _weighted(norm: nn.Module | None) -> nn.Module | None:
    """A norm the C stack runs (None for none, NoNorm's missing pre-norms included)."""
    return None if norm is None or isinstance(norm, NoNorm) else norm


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    embed_scale = 1.0  # the embeddings' multiplier (GemmaModel's sqrt(hidden))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.residual_norm_eps)
        # Granite's multipliers, folded (1 elsewhere): the residual stream carries h /
        # residual_multiplier (so each branch's output adds as it is, with residual_norm_eps
        # the norms see the same values) from embeddings scaled by embedding_multiplier /
        # residual_multiplier; the logits' divisor is folded into the final norm's weight at
        # load (load_weights).
        self.embed_scale = config.embedding_multiplier / config.residual_multiplier
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
            config.rope_dim,
        )
        # SmolLM3's NoPE layers: a table of cos 1, sin 0 (the same rotation code, no rotation)
        self.rotary_none = (RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                            config.rope_theta, None, 0)
                            if config.nope_layers else None)
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
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale == 1.0 else x * self.embed_scale

    def ropes(self, positions: torch.Tensor, fused: bool) -> tuple[Rope, ...]:
        """The step's rotations, indexed by the layers' `rope_index`."""
        made: dict[int, Rope] = {}  # one Rope a table, however many layers share it
        for r in self.rotaries():
            if id(r) not in made:
                made[id(r)] = Rope(r, positions, fused)
        return tuple(made[id(r)] for r in self.rotaries())

    def rotaries(self) -> tuple[RotaryEmbedding, ...]:
        """The rotary tables, indexed by the layers' `rope_index`: (RoPE, none where the model
        has NoPE layers)."""
        return (self.rotary_emb,) if self.rotary_none is None else (self.rotary_emb,
                                                                    self.rotary_none)


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
        return self.cap_logits(self.lm_head(hidden).float())  # [n, vocab]

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The output projection's logits -> the model's (GemmaForCausalLM soft-caps them)."""
        return logits

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
            if logits is not None:
                logits = self.cap_logits(logits)
        if logits is None and len(rows):
            logits = self.compute_logits(
                hidden if only_rows else hidden[torch.from_numpy(rows).to(hidden.device)])
        return hidden, logits

    def c_stack_refusal(self) -> str | None:
        """Why the one-call C decoder stack (int8) cannot run this model, or None if it can: the
        one place that says which models it runs (a refused model never builds it; the loader
        logs the reason). The stack runs what each layer's `stack_parts` describes; what it
        has no kernel for is named here."""
        return None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def init_buffers(self, device: torch.device) -> None:
        for rotary in dict.fromkeys(self.model.rotaries()):  # each table once
            rotary.build_cache(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        if self.config.rope_dim < self.config.head_dim or self.config.rotary_interleaved:
            weights = _partial_rotary_rows(weights, self.config)
        if self.config.logits_scaling != 1.0:
            weights = _final_norm_scaled(weights, 1.0 / self.config.logits_scaling)
        load_packed_weights(self, weights, self.packed_modules, skip=skip)


def _final_norm_scaled(weights: Iterable[tuple[str, torch.Tensor]], factor: float
                       ) -> Iterable[tuple[str, torch.Tensor]]:
    """The final norm's weight times `factor`: logits / logits_scaling (Granite) without a
    step of its own (the head is linear in it; the tied embeddings stay as they are)."""
    for name, w in weights:
        yield name, (w * factor if name == "model.norm.weight" else w)


def partial_rotary_order(head_dim: int, rotary_dim: int,
                         interleaved: bool = False) -> torch.Tensor:
    """A head's dims in the order Loom rotates them: Hugging Face rotates pairs (i, i + r / 2)
    of the first r = rotary_dim dims (`interleaved`, GLM's: pairs (2i, 2i + 1)) and passes the
    rest; Loom's table rotates pairs (i, i + head_dim / 2), the first r / 2 of them, and passes
    the others (angle 0). Reordered as [rotated firsts, passed first half, rotated seconds,
    passed second half], each HF pair lands on one of Loom's; q and k rows both reordered keep
    every q . k."""
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    d = torch.arange(head_dim)
    firsts, seconds = (d[0:2 * r:2], d[1:2 * r:2]) if interleaved else (d[:r], d[r:2 * r])
    return torch.cat([firsts, d[2 * r: 2 * r + rest], seconds, d[2 * r + rest:]])


def _partial_rotary_rows(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                         ) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's q and k rows (weights, biases, fused qkv's q and k parts; q/k norms'
    weights, a head's or all heads') in partial_rotary_order, head by head (a partial or
    interleaved rotary)."""
    D = config.head_dim
    order = partial_rotary_order(D, config.rope_dim, config.rotary_interleaved)
    q_rows, kv_rows = config.num_attention_heads * D, config.num_key_value_heads * D

    def heads(rows: int) -> torch.Tensor:  # the order over `rows` rows of whole heads
        return (torch.arange(0, rows, D)[:, None] + order).reshape(-1)

    q_order, kv_order = heads(q_rows), heads(kv_rows)
    fused = torch.cat([q_order, q_rows + kv_order, torch.arange(q_rows + kv_rows,
                                                                q_rows + 2 * kv_rows)])
    full = config.qk_norm_full  # (norms over all heads: their rows are q's and k's)
    orders = {"q_proj": q_order, "k_proj": kv_order, "qkv_proj": fused,
              "q_norm": q_order if full else order, "k_norm": kv_order if full else order}
    for name, w in weights:
        module, _, field = name.rpartition(".")
        kind = module.rpartition(".")[2]
        index = orders.get(kind)
        if index is not None and field not in ("weight", "bias"):
            raise ConfigError(f"partial rotary embeddings with {name!r} (a GPTQ / AWQ layout) "
                              "are not supported")
        if index is not None:
            w = select_rows(w, index)
        yield name, w
