"""The MLP's gated activations, act(gate) * up: SiLU (Llama) and GELU-tanh (Gemma).

On the CPU in fp32 each is one C kernel (layer_ops.c, norm_act.c), the one the decoder stack
(decoder_q8.c) runs, so both paths give the same bits; elsewhere torch's ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.kernels import cpu_kernels, cpu_ops

# loom.h's LOOM_ACT_* order (relu2: relu(x)^2 of an ungated MLP, Nemotron's ReluSquaredMLP)
ACTIVATIONS = ("silu", "gelu_tanh", "relu2")


def activation_of(hidden_act: str) -> str:
    """The checkpoint's `hidden_act` as one of ACTIVATIONS (Gemma's gelu_pytorch_tanh: gelu_tanh)."""
    return "gelu_tanh" if hidden_act.startswith("gelu") else "silu"


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [num_tokens, 2 * d] -> act(gate) * up [num_tokens, d]."""
    if cpu_ops.usable(gate_up) and gate_up.is_contiguous() and gate_up.dim() == 2:
        if activation == "silu":
            return cpu_ops.silu_mul(gate_up)
        n, d2 = gate_up.shape
        out = torch.empty((n, d2 // 2), dtype=gate_up.dtype)
        cpu_kernels().loom_gelu_tanh_mul_f32(gate_up.data_ptr(), out.data_ptr(), n, d2 // 2,
                                             torch.get_num_threads())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up
