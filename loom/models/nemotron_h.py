"""Nemotron-H (NVIDIA: Nemotron-H 4B-56B, Nemotron Nano 2, Nemotron 3 Nano): a hybrid whose
layers are each one block, a norm and one mixer with a residual add: Mamba2 (most of them),
attention without positions, an ungated MLP (up, relu(x)^2, down), or a mixture of such
experts (Nemotron 3: sigmoid scores plus a learned bias pick the top-k within the best
groups, weighted by their renormalised scores times routed_scaling_factor, a shared expert
beside them).

The model's config names the Mamba2 layers (`linear_layers`) and the MLP-only ones
(`mlp_only_layers`; `moe_layers` among them); the others attend. Checkpoints name every
block's module `mixer` under `backbone.`; at load they take the names of Loom's layers:
`mamba`, `self_attn`, `mlp`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from loom.attention.layer import Attention
from loom.config import ModelConfig
from loom.layers.linear import Linear
from loom.layers.mamba2 import Mamba2Mixer
from loom.layers.norm import RMSNorm
from loom.layers.recurrent import RecurrentMixer
from loom.layers.rotary import Rope
from loom.models.hybrid import HybridForCausalLM
from loom.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from loom.models.moe import SparseMoeBlock, expert_names, experts_refusal


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2): Nemotron's MLP, no gate (the C stack's LOOM_ACT_RELU2, its `gu`
    up alone)."""

    activation = "relu2"  # (loom.layers.activation.ACTIVATIONS)

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = self.intermediate_size = intermediate_size or config.intermediate_size
        self.up_proj = Linear(config.hidden_size, inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)

    @property
    def gate_up_proj(self) -> nn.Module:  # (what the stack's MLP description names `gu`)
        return self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHLayer(nn.Module):
    """One block: norm, then Mamba2 (`mamba`), attention (`self_attn`), or an MLP or mixture
    of experts (`mlp`)."""

    rope_index = 1  # (LlamaModel's table without rotation: no positions in attention)

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_linear = layer in config.linear_layers
        self.is_mlp = layer in config.mlp_only_layers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            assert config.mamba is not None
            self.mamba = Mamba2Mixer(config.hidden_size, config.mamba, config.rms_norm_eps)
        elif self.is_mlp and config.is_moe_layer(layer):
            self.mlp: nn.Module = SparseMoeBlock(config, ReluSquaredMLP)
        elif self.is_mlp:
            self.mlp = ReluSquaredMLP(config)
        else:
            self.self_attn = LlamaAttention(config, layer)

    def forward(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output, the residual stream before it), as LlamaDecoderLayer's; with
        `keep`, those rows alone (an MLP block runs on them only)."""
        if residual is None:
            residual, x = x, self.norm(x)
        else:
            x, residual = self.norm.add_norm(x, residual)
        if keep is not None and self.is_mlp:
            x, residual = x[keep], residual[keep]
            keep = None
        if self.is_linear:
            x = self.mamba(x)
        elif self.is_mlp:
            x = self.mlp(x) if x.shape[0] else x
        else:
            x = self.self_attn(rope, x)
        if keep is not None:
            x, residual = x[keep], residual[keep]
        return x, residual


    def stack_parts(self) -> dict[str, object]:
        """This block as the one-call C stack runs it (q8_decoder.LayerQ8; `block`: mix for
        attention or Mamba2 alone, mlp for an MLP alone on the norm's output)."""
        attn = None if (self.is_linear or self.is_mlp) else self.self_attn
        mlp = self.mlp if self.is_mlp else None
        moe = mlp if isinstance(mlp, SparseMoeBlock) else None
        dense = mlp if isinstance(mlp, ReluSquaredMLP) else None
        return dict(
            in_norm=self.norm, mlp_norm=None, q_norm=None, k_norm=None, attn_out_norm=None,
            mlp_out_norm=None, qk_norm_full=False, rope_index=self.rope_index,
            qkv=None if attn is None else attn.qkv_proj, o=None if attn is None else attn.o_proj,
            attn=None if attn is None else attn.attn, mixer=self.mamba if self.is_linear else None,
            gate_up=None if dense is None else dense.up_proj,
            down=None if dense is None else dense.down_proj, moe=moe, activation="relu2",
            block="mlp" if self.is_mlp else "mix")


class NemotronHModel(LlamaModel):
    layer_cls = NemotronHLayer


class NemotronHForCausalLM(HybridForCausalLM):
    # (no gate / up packing: its MLPs have no gate)
    packed_modules = {k: v for k, v in LlamaForCausalLM.packed_modules.items()
                      if k in ("q_proj", "k_proj", "v_proj")}
    model_cls = NemotronHModel

    def c_stack_refusal(self) -> str | None:
        """Its decode steps run the stack (one block a layer: loom.h's LOOM_BLOCK_*), its
        experts as moe.py's (Nemotron 3's group-limited routing refused)."""
        return experts_refusal(self.config)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers
                if not (layer.is_linear or layer.is_mlp)]

    def recurrent_layers(self) -> list[RecurrentMixer]:
        return [layer.mamba for layer in self.model.layers if layer.is_linear]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(expert_names(_nemotron_weights(weights, self.config)))


def _nemotron_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Nemotron-H's tensors under Loom's names: backbone. as model., each block's `mixer` as
    the layer's module (mamba, self_attn or mlp), the final norm norm_f as norm, the router's
    e_score_correction_bias as expert_bias and shared_experts as shared_expert; the
    multi-token prediction head (`mtp.`) left out."""
    kinds = np.full(config.num_hidden_layers, "self_attn", dtype=object)
    kinds[list(config.linear_layers)] = "mamba"
    kinds[list(config.mlp_only_layers)] = "mlp"
    for name, w in weights:
        if name.startswith("mtp."):
            continue
        name = name.replace("backbone.", "model.", 1).replace(".embeddings.", ".embed_tokens.")
        if name == "model.norm_f.weight":
            name = "model.norm.weight"
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[3] == "mixer":
            parts[3] = kinds[int(parts[2])]
            name = ".".join(parts)
        name = name.replace(".gate.e_score_correction_bias", ".expert_bias").replace(
            ".shared_experts.", ".shared_expert.")
        yield name, w
