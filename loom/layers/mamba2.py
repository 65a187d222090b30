"""Mamba2: the selective state space token mixer of Granite 4.0-H's and Nemotron-H's hybrid
layers.

in_proj gives each token a gate z [inner], the convolution's input xBC [inner + 2 G N] and a
time step per head dt [H]. xBC goes through a causal depthwise convolution (SiLU after), then
splits into x [H, P] (P = head_dim), B and C [G, N] (the heads of a group share them). Each
head keeps a state S [P, N] per request instead of a KV cache; per token, with
dt = clamp(softplus(dt + dt_bias)) and A = -exp(A_log) (a scalar a head):

    S <- exp(dt A) S + dt x B^T;   y = S C + D x

and the output is out_proj(RMSNorm(y * SiLU(z))), the norm over groups of the inner channels.
Decode rows run that step, batched over requests; a longer run of tokens runs it a chunk of
up to 64 tokens at a time (Mamba2's state space duality: within a chunk the outputs are a
masked, decayed product C B^T applied to dt x, plus the decayed read of the state the chunk
starts from), which gives the same outputs up to rounding. The recurrence runs in fp32; the
convolution's window and S are the request's states (loom/layers/recurrent.py). On the CPU
in fp32 a step's requests run instead as one C call a layer (csrc/mamba2.c: the window, the
state's decayed update and read, the gated norm, in place on the slots): decode and verify
rows token by token, a prompt's rows 8 at a time in the chunked form (not in batch-invariant
runs). Each head's S is stored transposed, [N, P] (the C step runs a head's channels across
vector lanes; _torch reads it through a transposed view). _torch stays the reference and the
path of every other device and dtype.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loom.config import MambaConfig
from loom.kernels import cpu_kernels, cpu_ops
from loom.layers.linear import Linear
from loom.layers.recurrent import (
    DRY_FLOATS, MIXER_MAMBA2, DepthwiseConv, RecurrentMixer, StepStates, causal_conv, stack_tensors,
)

CHUNK = 64  # tokens a chunk of the chunked form


def recurrent_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token for each of R requests: x [R, H, P], dt [R, H], a [H], b, c [R, H, N]
    (each head's group's); state [R, H, P, N] updated in place. Returns y [R, H, P] (D x
    not added)."""
    state.mul_((dt * a).exp()[..., None, None])
    state.add_((dt[..., None] * x)[..., None] * b[:, :, None, :])
    return (state @ c[..., None])[..., 0]


def chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """n tokens of one request: x [n, H, P], dt [n, H], a [H], b, c [n, G, N] (head h reads
    group h // (H / G)); state [H, P, N] updated in place. Returns y [n, H, P] (D x not added).

    Within a chunk, with L_i the running sum of dt A over the chunk: y_i = sum_{j <= i}
    exp(L_i - L_j) (c_i . b_j) dt_j x_j + exp(L_i) S_0 c_i, and the state it ends with
    exp(L_last) S_0 + sum_j exp(L_last - L_j) dt_j x_j b_j^T. The products c_i . b_j are a
    group's, once for its heads."""
    n = x.shape[0]
    size = min(CHUNK, n)
    pad = -n % size
    x, b, c = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (x, b, c))  # [H|G, N', d]
    dt = F.pad(dt.transpose(0, 1), (0, pad))  # [H, N'] (padded steps: dt 0, no effect)
    heads, groups, chunks = x.shape[0], b.shape[0], x.shape[1] // size
    x, b, c = (t.reshape(t.shape[0], chunks, size, -1) for t in (x, b, c))
    dt = dt.reshape(heads, chunks, size)
    group = torch.arange(heads, device=x.device) // (heads // groups)
    cum = (dt * a[:, None, None]).cumsum(-1)  # [H, C, size]
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    xdt = x * dt[..., None]  # [H, C, size, P]
    inner = (c @ b.transpose(-1, -2))[group] * decay  # [H, C, size, size]
    b, c = b[group], c[group]  # [H, C, size, N]
    out = inner @ xdt  # the chunk's own tokens
    c_decayed = c * cum.exp()[..., None]
    x_decayed = xdt * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()  # [H, C]
    writes = x_decayed.transpose(-1, -2) @ b  # [H, C, P, N]: what each chunk adds to the state
    starts = torch.empty_like(writes)  # the state each chunk starts from
    for k in range(chunks):
        starts[:, k] = state
        state.mul_(last[:, k, None, None]).add_(writes[:, k])
    out += c_decayed @ starts.transpose(-1, -2)  # [H, C, size, P]: the earlier chunks' part
    return out.reshape(heads, chunks * size, -1)[:, :n].transpose(0, 1)


class GroupedGatedNorm(nn.Module):
    """RMSNorm of y * SiLU(z) over each of `groups` equal groups of channels, times the weight
    (Mamba2's gate before the norm)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = (y * F.silu(z)).reshape(y.shape[0], self.groups, -1)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * y.reshape(y.shape[0], -1)


class Mamba2Mixer(RecurrentMixer):
    """A hybrid model's Mamba2 layer on a flattened batch of requests (the checkpoints' names:
    in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    def __init__(self, hidden_size: int, shape: MambaConfig, eps: float) -> None:
        super().__init__()
        self.shape = shape
        self.inner = shape.inner_size
        self.conv_dim = self.inner + 2 * shape.num_groups * shape.state_size
        heads = shape.num_heads
        self.in_proj = Linear(hidden_size, self.inner + self.conv_dim + heads,
                              bias=shape.proj_bias)
        self.conv1d = DepthwiseConv(self.conv_dim, shape.conv_kernel, shape.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GroupedGatedNorm(self.inner, shape.norm_groups, eps)
        self.out_proj = Linear(self.inner, hidden_size, bias=shape.proj_bias)

    def state_shapes(self) -> list[tuple[int, ...]]:
        """The convolution's window [conv_dim, conv_kernel - 1] and the state space's, each
        head's S stored transposed: [heads, state_size, head_dim] (the C step runs a head's
        channels across vector lanes; _torch reads it through a transposed view)."""
        s = self.shape
        return [(self.conv_dim, s.conv_kernel - 1), (s.num_heads, s.state_size, s.head_dim)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]; each request's states advance by its
        tokens (a step without state slots starts every request from zero, keeps nothing);
        mix_rows picks the C step or the torch path."""
        proj = self.in_proj(x).float()
        step = self.step_states(x.device)
        out = self.mix_rows(proj, step)
        return self.out_proj(out.to(x.dtype))

    def stack_fields(self) -> dict | None:
        """What the one-call C stack runs this mixer from on decode steps (loom.h's
        LoomMixerQ8; q8_decoder.MixerQ8), or None where its weights are not fp32 on the CPU."""
        s = self.shape
        tensors = dict(conv_w=self.conv1d.weight, conv_b=self.conv1d.bias, a_log=self.A_log,
                       dt_bias=self.dt_bias, d=self.D, norm_w=self.norm.weight)
        if not stack_tensors(tensors.values()):
            return None
        return dict(kind=MIXER_MAMBA2, **tensors, key_heads=s.num_groups,
                    value_heads=s.num_heads, dk=s.state_size, dv=s.head_dim,
                    width=s.conv_kernel, norm_groups=s.norm_groups, eps=self.norm.eps,
                    dt_min=s.time_step_min, dt_max=s.time_step_max,
                    chunked=int(self.chunked))

    def scratch_floats(self, rows: int) -> int:
        """The C decode step's scratch for steps of `rows` rows (the stack's)."""
        s = self.shape
        return cpu_kernels().loom_mamba2_scratch_floats(rows, s.num_heads, s.head_dim,
                                                         s.num_groups, s.state_size)

    def dry_fits(self) -> bool:
        return self.shape.head_dim * self.shape.state_size <= DRY_FLOATS

    def _fused(self, proj: torch.Tensor, step: StepStates, out: bool = True
               ) -> torch.Tensor | None:
        """The C decode step of `step`'s requests' in_proj rows -> [rows, inner]."""
        s = self.shape
        window_state, ssm_state = step.tensors
        return cpu_ops.mamba2_decode(
            proj, step.slots, window_state, self.conv1d.weight, self.conv1d.bias, ssm_state,
            self.dt_bias, self.A_log, self.D, self.norm.weight, s.num_heads, s.head_dim,
            s.num_groups, s.state_size, s.norm_groups, self.norm.eps, s.time_step_min,
            s.time_step_max, step.starts, step.dry, out, self.chunked)

    def _torch(self, proj: torch.Tensor, step: StepStates) -> torch.Tensor:
        """in_proj's rows [num_tokens, ...] of `step`'s requests -> the normed, gated output
        [num_tokens, inner] (fp32), in torch's ops."""
        s = self.shape
        heads, P, N, G = s.num_heads, s.head_dim, s.state_size, s.num_groups
        z, xbc, dt = proj.split([self.inner, self.conv_dim, heads], dim=-1)
        window_state, ssm_state = step.tensors
        ssm_state = ssm_state.transpose(-1, -2)  # [slots, heads, P, N] (a view)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        xbc = causal_conv(xbc, step, window_state, self.conv1d.weight.float(), bias, silu=True)
        xs, b, c = xbc.split([self.inner, G * N, G * N], dim=-1)
        xs = xs.reshape(-1, heads, P)
        group = torch.arange(heads, device=proj.device) // (heads // G)  # each head's group
        b, c = b.reshape(-1, G, N), c.reshape(-1, G, N)  # [T, G, N]
        dt = F.softplus(dt + self.dt_bias.float())
        if s.time_step_min > 0.0 or s.time_step_max != float("inf"):
            dt = dt.clamp(s.time_step_min, s.time_step_max)
        a = -self.A_log.float().exp()
        y = torch.empty_like(xs)
        starts, slots, one = step.starts, step.slots, step.one
        if one.any():  # every one-token request at once
            rows = torch.from_numpy(starts[:-1][one]).to(proj.device)
            index = torch.from_numpy(slots[one]).to(proj.device)
            state = ssm_state[index]
            y[rows] = recurrent_step(xs[rows], dt[rows], a, b[rows][:, group],
                                     c[rows][:, group], state)
            ssm_state[index] = state
        for r in np.flatnonzero(~one):
            lo, hi, slot = int(starts[r]), int(starts[r + 1]), int(slots[r])
            y[lo:hi] = chunked(xs[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], ssm_state[slot])
        y = y + self.D.float()[:, None] * xs
        return self.norm(y.reshape(-1, self.inner), z)
