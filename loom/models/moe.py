"""Mixtures of experts on the Llama layer: Qwen2-MoE, Qwen3-MoE and Mixtral.

A sparse layer's MLP is a router (`gate`: softmax over experts, top-k, renormalised where the
checkpoint says so) and one gated MLP an expert (`experts[e]`: a LlamaMLP, so each expert's
gate/up and down projections are Loom linears: fp32, Loom's int8 grid, or GGUF K-quant blocks as
the file stores them); Qwen2-MoE adds a shared expert behind a sigmoid gate. The batch's (token,
expert) pairs are sorted by expert, so each active expert runs one product pair over its group
of tokens: the Python loop is over active experts, never over tokens. On the CPU in fp32 the
route and the weighted sum are the C stack's own kernels (decoder_q8.c), and the stack runs the
whole block in its call (MoeDecoderLayer.stack_parts' `moe`): both give the same bits.
Checkpoints store each expert apart (Mixtral as w1/w3/w2 under block_sparse_moe; Hugging Face 5
may store them stacked: split at load).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from loom.config import ModelConfig
from loom.kernels import cpu_kernels, cpu_ops
from loom.layers.router import RouterLinear
from loom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from loom.quant.int8 import GROUP


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, mlp_cls: type[nn.Module] = LlamaMLP) -> None:
        """`mlp_cls(config, width)`: an expert's MLP (and the shared expert's); Llama's gated
        one unless the model's is another."""
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = RouterLinear(config.hidden_size, config.num_experts)  # fp32, always
        self.experts = nn.ModuleList(
            mlp_cls(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.sigmoid = config.moe_router == "sigmoid"
        self.scaling = config.routed_scaling_factor
        self.groups, self.topk_groups = config.moe_groups, config.moe_topk_groups
        if self.sigmoid:  # the per-expert bias added to the scores that pick the experts
            self.expert_bias = nn.Parameter(torch.zeros(config.num_experts),
                                            requires_grad=False)
        self.shared_expert: nn.Module | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = mlp_cls(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = (RouterLinear(config.hidden_size, 1)
                                       if config.shared_expert_gated else None)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [num_tokens, num_experts] -> (weights, experts) [num_tokens, top_k]."""
        if self.sigmoid:
            scores = logits.float().sigmoid()
            choice = self.limit_groups(scores + self.expert_bias.float())
            experts = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
            return weights * self.scaling, experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Choice scores [num_tokens, num_experts] with the experts outside each token's best
        `topk_groups` groups (a group scored by its best two) at -inf (as they are without
        groups)."""
        if self.groups == 1:
            return choice
        grouped = choice.reshape(choice.shape[0], self.groups, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [n, groups]
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, best.topk(self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).reshape(choice.shape)

    def run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [pairs, hidden] grouped by expert (`counts[e]` rows of expert e, in order) ->
        each row through its expert, in its place (as the C stack's scratch): one call an
        active expert."""
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows[start: start + n] = self.experts[e](rows[start: start + n])
                start += n
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [num_tokens, num_experts]
        if cpu_ops.usable(logits) and x.is_contiguous() and self.groups == 1:
            return self._forward_c(x, logits)  # (C: no group limiting)
        weights, experts = self.route(logits)  # [num_tokens, top_k]
        flat = experts.reshape(-1)  # [num_tokens * top_k] (token, slot) pairs
        order = torch.argsort(flat, stable=True)  # grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token = order // self.top_k  # the token of each sorted pair
        out = self.run_experts(x[token], counts)  # [pairs, hidden]
        out *= weights.reshape(-1)[order, None].to(out.dtype)
        out = torch.zeros_like(x).index_add_(0, token, out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out


    def _forward_c(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """forward with the C stack's route and weighted sum (decoder_q8.c), so the module
        path and the stack give the same bits: x [num_tokens, hidden] fp32 on the CPU."""
        lib, (m, hidden), k = cpu_kernels(), x.shape, self.top_k
        logits = logits.contiguous()  # overwritten by the probabilities
        counts = torch.empty(len(self.experts), dtype=torch.int64)
        pair_token = torch.empty(m * k, dtype=torch.int64)  # grouped by expert
        pair_weight = torch.empty(m * k)
        token_pairs = torch.empty((m, k), dtype=torch.int64)  # each token's pairs
        bias = self.expert_bias.float().contiguous() if self.sigmoid else None
        rc = lib.loom_moe_route_f32(logits.data_ptr(), m, len(self.experts), k,
                                    int(self.norm_topk_prob),
                                    None if bias is None else bias.data_ptr(),
                                    self.scaling if self.sigmoid else 1.0, counts.data_ptr(),
                                    pair_token.data_ptr(), pair_weight.data_ptr(),
                                    token_pairs.data_ptr())
        if rc != 0:
            raise RuntimeError(f"mixture-of-experts route failed ({rc})")
        y = self.run_experts(x[pair_token], counts.tolist())  # [pairs, hidden]
        shared = gate = None
        if self.shared_expert is not None:
            shared = self.shared_expert(x).contiguous()  # [num_tokens, hidden]
            if self.shared_expert_gate is not None:  # [num_tokens, 1]
                gate = self.shared_expert_gate(x).contiguous()
        out = torch.empty_like(x)
        lib.loom_moe_combine_f32(y.data_ptr(), pair_weight.data_ptr(), token_pairs.data_ptr(),
                                 m, k, hidden, None if shared is None else shared.data_ptr(),
                                 None if gate is None else gate.data_ptr(), out.data_ptr(),
                                 torch.get_num_threads())
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        if config.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(config)

    def stack_parts(self) -> dict[str, object]:
        """LlamaDecoderLayer's, with `moe` the layer's SparseMoeBlock (None: a dense MLP) and
        its experts' activation."""
        parts = super().stack_parts()
        parts["moe"] = None
        if isinstance(self.mlp, SparseMoeBlock):
            parts["moe"], parts["activation"] = self.mlp, self.mlp.experts[0].activation
        return parts


class MoeModel(LlamaModel):
    layer_cls = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE, Qwen3-MoE and Mixtral (registered under each name)."""

    model_cls = MoeModel

    def c_stack_refusal(self) -> str | None:
        return experts_refusal(self.config) or super().c_stack_refusal()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(expert_names(weights))


def experts_refusal(c: ModelConfig) -> str | None:
    """What of a model's mixtures of experts the C stack cannot run (None: all of it): an
    expert's (or the shared expert's) width its linears cannot take (its down projection's
    inputs, on the int8 grid or K-quant blocks only in multiples of 32), group-limited
    routing."""
    if not c.num_experts:
        return None
    for what, width in (("experts", c.moe_intermediate_size),
                        ("shared expert", c.shared_expert_intermediate_size)):
        if width % GROUP:
            return (f"{c.architecture}'s {what} of width {width} (its int8 kernels take "
                    f"multiples of {GROUP})")
    if c.moe_groups > 1:
        return f"{c.architecture}'s group-limited expert router"
    return None


# Mixtral's names -> Qwen-MoE's
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Hugging Face 5's stacked experts: [num_experts, 2 * inter, hidden] gate_up, [.., hidden, inter]
_STACKED_RE = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?$")


def expert_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under Loom's names: Mixtral's block_sparse_moe.experts.E.w1/w3/w2 as
    mlp.experts.E.gate_proj/up_proj/down_proj, stacked experts split into one tensor an
    expert; the rest as they are (each expert's gate and up pack into its gate_up_proj)."""
    for name, w in weights:
        if ".block_sparse_moe." in name:
            name = re.sub(r"\.(w1|w2|w3)\.", lambda m: f".{_MIXTRAL[m[1]]}.",
                          name.replace(".block_sparse_moe.", ".mlp."))
        if name.endswith((".mlp.gate.weight", "shared_expert_gate.weight")) and hasattr(
                w, "dequantize"):  # GGUF blocks: the router's weights stay fp32
            w = w.dequantize()
        m = _STACKED_RE.match(name)
        if m is not None and isinstance(w, torch.Tensor) and w.dim() == 3:
            for e in range(w.shape[0]):
                yield f"{m[1]}.{e}.{m[2]}.weight", w[e]
            continue
        yield name, w
