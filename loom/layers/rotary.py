"""Rotary position embedding (neox / rotate-half layout, as Hugging Face applies it)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, smooth in between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention scaling for a context `factor` times the original (transformers' and
    llama.cpp's 0.1 m ln(factor) + 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any],
                   max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen's and DeepSeek's long contexts; transformers' `_compute_yarn_parameters`):
    frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those that turn more than beta_fast times kept, a linear
    ramp between; cos/sin scaled by the attention factor (0.1 ln(factor) + 1 by default)."""
    orig = int(scaling.get("original_max_position_embeddings") or max_position)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / orig

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                else yarn_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency kept as it is (extrapolated)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attn)


def rope_freqs(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int,
    start: int = 0, stop: int | None = None, rotary_dim: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(freqs [stop - start, head_dim // 2]: positions start..stop-1's rotation angles (default
    all max_position), attention scaling applied to cos/sin) for the checkpoint's rope
    scaling. A row depends on its position alone: a table filled in pieces is the same.
    `rotary_dim` < head_dim (partial rotary): the frequencies of a head of rotary_dim dims,
    then zeros (angle 0: the other dims pass unrotated; RotaryEmbedding's table leaves them
    unscaled too)."""
    dim = head_dim if rotary_dim is None else rotary_dim
    freqs, attn = _rotary_freqs(dim, theta, scaling, max_position, start, stop)
    if dim < head_dim:
        freqs = torch.cat([freqs, freqs.new_zeros(freqs.shape[0], (head_dim - dim) // 2)], 1)
    return freqs, attn


def _rotary_freqs(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int,
    start: int, stop: int | None,
) -> tuple[torch.Tensor, float]:
    t = torch.arange(start, max_position if stop is None else stop, dtype=torch.float32)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / base
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return torch.outer(t, inv_freq), 1.0
    assert scaling is not None
    attn = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "freq_factors":  # GGUF rope_freqs tensor (Llama 3.1 written by llama.cpp)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attn = _yarn_inv_freq(inv_freq, dim, theta, scaling, max_position)
    elif rope_type in ("longrope", "su"):
        return _longrope_freqs(t, base, scaling, max_position)
    else:
        raise ConfigError(f"unsupported rope scaling type {rope_type!r} "
                          "(supported: linear, llama3, yarn, longrope/su)")
    return torch.outer(t, inv_freq), attn


def _longrope_freqs(
    t: torch.Tensor, base: torch.Tensor, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ("su"): per-frequency divisors of `base` (theta ** (2i / dim), dim the
    rotated dims), `short_factor` for positions below original_max_position_embeddings and
    `long_factor` from there on (vLLM's table; Hugging Face re-rotates a whole sequence with the
    long factors once it outgrows the original length), and cos/sin scaled by the attention
    factor."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position / orig)
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * base)
                   for k in ("short_factor", "long_factor"))
    if short.shape != base.shape or long.shape != base.shape:
        raise ConfigError(f"longrope factors of {short.numel()} and {long.numel()} values for "
                          f"{base.numel()} rotary frequencies")
    freqs = torch.where((t < orig)[:, None], torch.outer(t, short), torch.outer(t, long))
    return freqs, float(attn)


FIRST_ROWS = 4096  # positions of a CPU table filled at load (RotaryEmbedding.build_cache)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # Partial rotary (rotary_dim < head_dim): the table rotates pairs (i, i + head_dim / 2)
        # for i < rotary_dim / 2 and leaves the others as they are; the checkpoint's q/k rows
        # are reordered at load so that Hugging Face's pairs (i, i + rotary_dim / 2) land there
        # (loom.models.llama.partial_rotary_order). 0: no dim rotates (SmolLM3's NoPE layers).
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.filled = 0  # rows of cos_sin_cache computed so far

    def build_cache(self, device: torch.device) -> None:
        """Make the cos/sin table in fp32; called once after the model is materialized.

        Row p holds [cos, cos, -sin, sin] (each head_dim // 2 wide): cos for both halves of a
        head, and sin carrying rotate-half's sign, so rotating is x * cos + swap_halves(x) * sin
        with no negation or split per layer, bit for bit Hugging Face's q * cos + rotate_half(q)
        * sin. On the CPU the table is allocated whole (its address fixed: the C stack keeps it)
        but filled only up to FIRST_ROWS positions; `ensure` fills more, doubling, as positions
        reach them: a 32k-position table of head_dim 256 is 64 MiB (Gemma 3 has two), most of
        it never read by short sequences, and untouched pages take no memory."""
        rows, width = self.max_position, 2 * self.head_dim
        self.cos_sin_cache = torch.empty((rows, width), dtype=torch.float32, device=device)
        self.filled = 0
        self._fill(rows if device.type != "cpu" else min(rows, FIRST_ROWS))

    def _fill(self, stop: int) -> None:
        """Compute rows [filled, stop)."""
        start = self.filled
        if stop <= start:
            return
        freqs, attn_scale = rope_freqs(self.head_dim, self.theta, self.scaling,
                                       self.max_position, start, stop,
                                       self.rotary_dim)  # [rows, head_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        rotated = self.rotary_dim // 2  # the pairs past it pass as they are: cos 1, sin 0
        cos[:, :rotated] *= attn_scale
        sin[:, :rotated] *= attn_scale
        self.cos_sin_cache[start:stop] = torch.cat([cos, cos, -sin, sin], dim=-1).to(
            self.cos_sin_cache.device)
        self.filled = stop

    def ensure(self, positions: torch.Tensor) -> None:
        """Fill the table up to `positions`' largest (at least doubling what is filled); called
        before any step reads it (Rope, Q8Decoder.forward). Positions past the table are
        left for check_positions to refuse."""
        if self.filled >= self.max_position or not positions.numel():
            return
        self.ensure_rows(int(positions.max()) + 1)

    def ensure_rows(self, need: int) -> None:
        """`ensure` for a step whose largest position is need - 1 (known to the caller)."""
        if need > self.filled:  # (_fill does nothing once the table is whole)
            self._fill(min(max(need, 2 * self.filled), self.max_position))

    def check_positions(self, positions: torch.Tensor) -> None:
        """C kernels read table rows unchecked (index_select would raise): check once a step."""
        rows = self.cos_sin_cache.shape[0]
        if positions.numel() and int(positions.max()) >= rows:
            raise IndexError(
                f"position {int(positions.max())} past the rotary table ({rows} positions)"
            )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [num_tokens, 1, head_dim] for `positions`; shared by every layer."""
        rows = self.cos_sin_cache.index_select(0, positions).view(-1, 2, self.head_dim)
        return rows[:, :1], rows[:, 1:]


class Rope:
    """One step's rotary inputs, shared by every layer: the fp32 table and token positions, and
    (on first use) the cos / signed-sin rows the torch path multiplies by."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, fused: bool) -> None:
        self.table = rotary.cos_sin_cache
        self.positions = positions
        self.fused = fused  # the C kernel rotates and writes K/V (CPU, fp32)
        rotary.ensure(positions)
        if fused:
            rotary.check_positions(positions)
        self._rotary = rotary
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = self._rotary.cos_sin(self.positions)
        return self._cos_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] (any mix of q and k heads) by `cos_sin`'s tables."""
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat([x2, x1], dim=-1) * sin
    return out.to(dtype)
