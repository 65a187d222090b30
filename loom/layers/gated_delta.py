"""Gated DeltaNet: the linear-attention token mixer of hybrid models (Qwen3.5, Qwen3-Next).

Each value head keeps a state S [key_head_dim, value_head_dim] per request instead of a KV
cache. Per token t, with q, k L2-normalised (q also scaled by key_head_dim ** -0.5), a decay
g_t <= 0 and a write strength beta_t in (0, 1):

    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

(the delta rule: the part of v_t the state already predicts from k_t is not written again).
On the CPU in fp32 a step's requests run in C (csrc/gated_delta.c): decode and verify rows
token by token, a prompt's rows 8 at a time in the chunkwise form below (the state read twice
and written once a chunk, in register-blocked products; not in batch-invariant runs, whose
bits must not depend on where a prompt was split). The torch path (_torch: every other device
and dtype) runs one-token requests' steps batched and a longer run of tokens a chunk of up to
64 at a time (the WY form of DeltaNet's chunkwise algorithm: a triangular solve per chunk, then
matrix products against the state), which gives the same outputs up to rounding.

q, k and v come through a causal depthwise convolution (width `conv_kernel`, SiLU), whose last
conv_kernel - 1 inputs are the other per-request state (both kept as loom/layers/recurrent.py
says). The recurrence runs in fp32.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loom.config import LinearAttnConfig
from loom.kernels import cpu_kernels, cpu_ops
from loom.layers.linear import Linear
from loom.layers.recurrent import (
    DRY_FLOATS, MIXER_GDN, DepthwiseConv, RecurrentMixer, StepStates, causal_conv, stack_tensors,
)

CHUNK = 64  # tokens a chunk of the chunkwise form


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's, as transformers')."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token for each of R requests: q, k [R, H, dk], v [R, H, dv], g, beta [R, H];
    state [R, H, dk, dv] updated in place. Returns o [R, H, dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("rhkv,rhk->rhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("rhkv,rhk->rhv", state, q)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """n tokens of one request: q, k [n, H, dk], v [n, H, dv], g, beta [n, H]; state [H, dk,
    dv] updated in place. Returns o [n, H, dv].

    Within a chunk, with G_i the running sum of g over the chunk and D_ij = exp(G_i - G_j)
    (i >= j): the writes the recurrence makes are u = T (beta v) - T (beta exp(G) k) S_0, where
    T = (I + L)^-1 and L_ij = beta_i (k_i . k_j) D_ij below the diagonal; then
    o = exp(G) q S_0 + (q k^T * D) u and S = exp(G_last) S_0 + (exp(G_last - G) k)^T u."""
    n = q.shape[0]
    size = min(CHUNK, n)
    pad = -n % size
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [H, N, d]
    g, beta = (F.pad(t.transpose(0, 1), (0, pad)) for t in (g, beta))  # [H, N]
    heads, chunks = q.shape[0], q.shape[1] // size
    q, k, v = (t.reshape(heads, chunks, size, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, chunks, size), beta.reshape(heads, chunks, size)
    cum = g.cumsum(-1)  # [H, C, size]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(size, dtype=q.dtype, device=q.device)
    writes = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()  # [H, C]
    out = torch.empty_like(v)
    for c in range(chunks):
        u = writes[:, c] - reads[:, c] @ state  # [H, size, dv]
        out[:, c] = q_decayed[:, c] @ state + inner[:, c] @ u
        state.mul_(last[:, c, None, None]).add_(k_decayed[:, c].transpose(-1, -2) @ u)
    return out.reshape(heads, chunks * size, -1)[:, :n].transpose(0, 1)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times SiLU(z) (the weight unshifted, unlike the model's
    other norms)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * x * F.silu(z.float())


class GatedDeltaNet(RecurrentMixer):
    """The token mixer of a hybrid model's linear layers, on a flattened batch of requests.

    in_proj packs Hugging Face's in_proj_qkv (q, k, v: the convolution's channels), in_proj_z
    (the output gate), in_proj_b (beta's logits) and in_proj_a (the decay's input)."""

    def __init__(self, hidden_size: int, shape: LinearAttnConfig, eps: float) -> None:
        super().__init__()
        self.shape = shape
        self.key_dim = shape.num_key_heads * shape.key_head_dim
        self.value_dim = shape.num_value_heads * shape.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        heads = shape.num_value_heads
        self.in_proj = Linear(hidden_size, self.conv_dim + self.value_dim + 2 * heads,
                              bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, shape.conv_kernel)
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(shape.value_head_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)

    def shard_sizes(self) -> list[int]:
        """in_proj's rows per packed checkpoint tensor (qkv, z, b, a)."""
        heads = self.shape.num_value_heads
        return [self.conv_dim, self.value_dim, heads, heads]

    def state_shapes(self) -> list[tuple[int, ...]]:
        """The convolution's window [conv_dim, conv_kernel - 1] and the delta rule's state
        [value heads, key_head_dim, value_head_dim]."""
        s = self.shape
        return [(self.conv_dim, s.conv_kernel - 1),
                (s.num_value_heads, s.key_head_dim, s.value_head_dim)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]; each request's states advance by its
        tokens (a step without state slots, a memory-profiling one, starts every request from
        zero and keeps nothing); mix_rows picks the C step or the torch path."""
        proj = self.in_proj(x).float()
        step = self.step_states(x.device)
        out = self.mix_rows(proj, step)
        return self.out_proj(out.to(x.dtype))

    def stack_fields(self) -> dict | None:
        """What the one-call C stack runs this mixer from on decode steps (loom.h's
        LoomMixerQ8; q8_decoder.MixerQ8), or None where its weights are not fp32 on the CPU."""
        s = self.shape
        tensors = dict(conv_w=self.conv1d.weight, a_log=self.A_log, dt_bias=self.dt_bias,
                       norm_w=self.norm.weight)
        if not stack_tensors(tensors.values()):
            return None
        return dict(kind=MIXER_GDN, **tensors, key_heads=s.num_key_heads,
                    value_heads=s.num_value_heads, dk=s.key_head_dim, dv=s.value_head_dim,
                    width=s.conv_kernel, tiled=int(s.tiled_heads), eps=self.norm.eps,
                    chunked=int(self.chunked))

    def scratch_floats(self, rows: int) -> int:
        """The C decode step's scratch for steps of `rows` rows (the stack's)."""
        s = self.shape
        return cpu_kernels().loom_gdn_scratch_floats(rows, s.num_key_heads, s.num_value_heads,
                                                      s.key_head_dim, s.value_head_dim)

    def dry_fits(self) -> bool:
        return self.shape.key_head_dim * self.shape.value_head_dim <= DRY_FLOATS

    def _fused(self, proj: torch.Tensor, step: StepStates, out: bool = True
               ) -> torch.Tensor | None:
        """The C decode step of `step`'s requests' in_proj rows -> [rows, value_dim]."""
        s = self.shape
        return cpu_ops.gdn_decode(
            proj, step.slots, self.states[0], self.conv1d.weight, self.states[1], self.A_log,
            self.dt_bias, self.norm.weight, s.num_key_heads, s.num_value_heads, s.key_head_dim,
            s.value_head_dim, s.tiled_heads, self.norm.eps, step.starts, step.dry, out,
            self.chunked)

    def _torch(self, proj: torch.Tensor, step: StepStates) -> torch.Tensor:
        """in_proj's rows [num_tokens, ...] of `step`'s requests -> the normed heads' output
        [num_tokens, value_dim] (fp32), in torch's ops."""
        s = self.shape
        heads, dk, dv = s.num_value_heads, s.key_head_dim, s.value_head_dim
        mixed, z, b, a = proj.split(self.shard_sizes(), dim=-1)
        window_state, ssm_state = step.tensors
        mixed = causal_conv(mixed, step, window_state, self.conv1d.weight.float(), silu=True)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(-1, s.num_key_heads, dk)) * dk**-0.5
        k = l2norm(k.reshape(-1, s.num_key_heads, dk))
        group = heads // s.num_key_heads
        if group > 1 and s.tiled_heads:  # value head j reads key head j % key heads
            q, k = q.repeat(1, group, 1), k.repeat(1, group, 1)
        elif group > 1:  # value head j reads key head j // group
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        v = v.reshape(-1, heads, dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        out = torch.empty_like(v)
        starts, slots, one = step.starts, step.slots, step.one
        if one.any():  # every one-token request at once
            rows = torch.from_numpy(starts[:-1][one]).to(proj.device)
            index = torch.from_numpy(slots[one]).to(proj.device)
            state = ssm_state[index]
            out[rows] = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
            ssm_state[index] = state
        for r in np.flatnonzero(~one):
            lo, hi, slot = int(starts[r]), int(starts[r + 1]), int(slots[r])
            state = ssm_state[slot]
            out[lo:hi] = chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        return self.norm(out, z.reshape(-1, heads, dv)).reshape(-1, self.value_dim)
