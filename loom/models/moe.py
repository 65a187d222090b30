"""Mixtures of experts on the Llama layer: Qwen2-MoE, Qwen3-MoE and Mixtral.

A sparse layer's MLP is a router (`gate`: softmax over experts, top-k, renormalised where the
checkpoint says so) and the experts' weights stacked ([num_experts, 2 * inter, hidden] gate and
up, [num_experts, hidden, inter] down); Qwen2-MoE adds a shared expert behind a sigmoid gate.
The batch's (token, expert) pairs are sorted by expert, so each active expert runs one matmul
over its group of tokens: the Python loop is over active experts, never over tokens. Checkpoints
store each expert apart (Mixtral as w1/w3/w2 under block_sparse_moe); loading stacks them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.layers.linear import Linear
from loom.quant.int8 import Q8Groups
from loom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class FusedExperts(nn.Module):
    """Every expert's gate/up and down projections, stacked (Hugging Face 5's layout)."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """x [num_tokens, hidden]; weights, experts [num_tokens, top_k] -> [num_tokens, hidden]."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)  # [num_tokens * top_k] (token, slot) pairs
        order = torch.argsort(flat, stable=True)  # grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token = order // top_k  # the token of each sorted pair
        rows = x[token]  # [pairs, hidden]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):  # one matmul pair per active expert
            if n:
                gate, up = F.linear(rows[start: start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
                out[start: start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
        out *= weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = FusedExperts(config.num_experts, config.hidden_size,
                                    config.moe_intermediate_size)
        self.shared_expert: LlamaMLP | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [num_tokens, num_experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [num_tokens, top_k]
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        if config.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(config)


class MoeModel(LlamaModel):
    layer_cls = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE, Qwen3-MoE and Mixtral (registered under each name)."""

    model_cls = MoeModel

    def c_stack_refusal(self) -> str | None:
        return (f"{self.config.architecture}'s mixture-of-experts blocks (no batched-experts "
                "C kernel yet)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_stack_experts(weights, self.config))


# Mixtral's names -> Qwen-MoE's
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_RE = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED_RE = re.compile(r"(.*\.mlp\.shared_expert)\.(gate_proj|up_proj)\.weight$")


def _stack_experts(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint tensors -> each layer's stacked `experts.gate_up_proj` and
    `experts.down_proj`, yielded once all its experts arrived (and the shared expert's gate and
    up as one `gate_up_proj`); other tensors pass through."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    num = config.num_experts
    for name, w in weights:
        if ".block_sparse_moe." in name:
            name = re.sub(r"\.(w1|w2|w3)\.", lambda m: f".{_MIXTRAL[m[1]]}.",
                          name.replace(".block_sparse_moe.", ".mlp."))
        m = _EXPERT_RE.match(name) or _SHARED_RE.match(name)
        if m is None:
            yield name, w
            continue
        prefix = m.group(1)
        key = (int(m.group(2)), m.group(3)) if m.re is _EXPERT_RE else (0, m.group(2))
        got = pending.setdefault(prefix, {})
        got[key] = w.dequantize() if isinstance(w, Q8Groups) else w
        if m.re is _SHARED_RE:
            if len(got) == 2:
                del pending[prefix]
                yield f"{prefix}.gate_up_proj.weight", torch.cat(
                    [got[(0, "gate_proj")], got[(0, "up_proj")]])
        elif len(got) == 3 * num:
            del pending[prefix]
            yield f"{prefix}.experts.gate_up_proj", torch.stack(
                [torch.cat([got[(e, "gate_proj")], got[(e, "up_proj")]]) for e in range(num)])
            yield f"{prefix}.experts.down_proj", torch.stack(
                [got[(e, "down_proj")] for e in range(num)])
    if pending:
        raise ValueError(f"checkpoint lacks some experts of {sorted(pending)[:5]}")
