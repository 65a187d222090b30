"""Fused decoder-layer ops through the C kernels (csrc/layer_ops.c): fp32 on the CPU only.

`usable(x)` says whether they apply to activations `x`; the model keeps its torch path for every
other case (CUDA, bf16/fp16 activations, no compiler, LOOM_CPU_KERNELS=0).
"""

from __future__ import annotations

import numpy as np
import torch

from loom.kernels import KV_TYPES, cpu_kernels, kv_pointers, kv_type


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels() is not None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.max(dim=-1).indices of x [rows, n] (the first of ties; a row's first NaN if it has one),
    in one C pass over fp32 rows on the CPU: torch's reduction over a large vocabulary was a
    visible share of a many-stream step (docs/cpu_kernels.md). Other tensors: torch."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1
            or x.shape[1] == 0 or cpu_kernels() is None):
        return x.max(dim=-1).indices
    out = torch.empty(x.shape[0], dtype=torch.int64)
    cpu_kernels().loom_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                   out.data_ptr(), torch.get_num_threads())
    return out


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x (if given), then x = rms_norm(residual or x) * weight.
    x, residual [num_tokens, hidden], contiguous fp32."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    n, d = x.shape
    cpu_kernels().loom_add_rms_norm_f32(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        n, d, eps, torch.get_num_threads(),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] -> silu(gate) * up [num_tokens, d]."""
    assert gate_up.is_contiguous()
    n, d2 = gate_up.shape
    out = torch.empty((n, d2 // 2), dtype=gate_up.dtype)
    cpu_kernels().loom_silu_mul_f32(
        gate_up.data_ptr(), out.data_ptr(), n, d2 // 2, torch.get_num_threads()
    )
    return out


def sigmoid_mul_(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x [n, d] *= sigmoid(gate [n, d]) in place (fp32, contiguous): the C stack's kernel."""
    assert x.is_contiguous() and gate.is_contiguous() and x.shape == gate.shape
    n, d = x.shape
    cpu_kernels().loom_sigmoid_mul_f32(x.data_ptr(), gate.data_ptr(), n, d,
                                       torch.get_num_threads())


def rope_write_kv_(
    qkv: torch.Tensor,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    table: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
) -> None:
    """Rotate the q and k heads of packed qkv rows [num_tokens, (heads + 2 kv_heads) head_dim]
    in place by `table` rows (loom/layers/rotary.py layout) at `positions`, then write k and v
    into `kv_cache` [2, num_blocks, block_size, kv_heads, row] (fp32, fp16 or int8) at
    `slot_mapping`."""
    assert qkv.stride(1) == 1 and table.is_contiguous()
    assert kv_cache.dtype in KV_TYPES
    assert positions.dtype == slot_mapping.dtype == torch.int64
    assert positions.is_contiguous() and slot_mapping.is_contiguous()
    cpu_kernels().loom_rope_write_kv_f32(
        qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, kv_heads, head_dim,
        table.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
        *kv_pointers(kv_cache), torch.get_num_threads(), kv_type(kv_cache),
    )


def _mixer_rows(proj: torch.Tensor, slots: np.ndarray, starts: np.ndarray | None,
                dry: np.ndarray | None) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None,
                                                 np.ndarray | None]:
    """A mixer decode step's rows (contiguous), slots, starts and dry flags as its C kernel
    reads them (starts None: a row a request)."""
    index = np.ascontiguousarray(slots, dtype=np.int64)
    if starts is not None:
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        assert len(starts) == len(index) + 1 and starts[-1] == proj.shape[0]
    else:
        assert proj.shape[0] == len(index)
    if dry is not None:
        dry = np.ascontiguousarray(dry, dtype=np.int8)
        assert len(dry) == len(index)
    return proj.contiguous(), index, starts, dry


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def gdn_decode(proj: torch.Tensor, slots: np.ndarray, conv_state: torch.Tensor,
               conv_w: torch.Tensor, ssm_state: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, norm_w: torch.Tensor, key_heads: int, value_heads: int,
               dk: int, dv: int, tiled: bool, eps: float, starts: np.ndarray | None = None,
               dry: np.ndarray | None = None, out: bool = True, chunked: bool = False
               ) -> torch.Tensor | None:
    """Gated DeltaNet's decode step (csrc/gated_delta.c): proj [rows, conv_dim + value_dim + 2
    value_heads] fp32 (in_proj's rows), request r's rows [starts[r], starts[r + 1]) one after
    another (starts None: a row a request) on its state slot; the states [slots, ...] (fp32,
    contiguous) updated in place but for `dry` requests'. Returns [rows, value_heads * dv]
    (None: `out` False, the states alone move). `chunked`: a prompt's run of rows may take
    the chunkwise form (the same outputs up to rounding; not a dry request's, nor a commit's)."""
    proj, index, starts, dry = _mixer_rows(proj, slots, starts, dry)
    y = torch.empty(proj.shape[0], value_heads * dv) if out else None
    f32 = [t.float().contiguous() for t in (conv_w, a_log, dt_bias, norm_w)]
    assert conv_state.is_contiguous() and ssm_state.is_contiguous()
    status = cpu_kernels().loom_gdn_decode_f32(
        proj.data_ptr(), proj.stride(0), index.ctypes.data, len(index), _ptr(starts), _ptr(dry),
        conv_state.data_ptr(), f32[0].data_ptr(), ssm_state.data_ptr(), f32[1].data_ptr(),
        f32[2].data_ptr(), f32[3].data_ptr(), key_heads, value_heads, dk, dv, conv_w.shape[1],
        int(tiled), int(chunked), eps, None if y is None else y.data_ptr(),
        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"Gated DeltaNet decode step failed ({status}: no memory for its "
                           f"scratch, or a head wider than 1024: {dk}, {dv})")
    return y


def mamba2_decode(proj: torch.Tensor, slots: np.ndarray, conv_state: torch.Tensor,
                  conv_w: torch.Tensor, conv_b: torch.Tensor | None, ssm_state: torch.Tensor,
                  dt_bias: torch.Tensor, a_log: torch.Tensor, d: torch.Tensor,
                  norm_w: torch.Tensor, heads: int, head_dim: int, groups: int,
                  state_size: int, norm_groups: int, eps: float, dt_min: float,
                  dt_max: float, starts: np.ndarray | None = None,
                  dry: np.ndarray | None = None, out: bool = True, chunked: bool = False
                  ) -> torch.Tensor | None:
    """Mamba2's decode step (csrc/mamba2.c): proj [rows, inner + conv_dim + heads] fp32
    (in_proj's rows: z, x B C, dt), each request's rows one after another as gdn_decode's;
    the states [slots, ...] (fp32, contiguous; a head's [state_size, head_dim]) updated in
    place but for `dry` requests'; `chunked` as gdn_decode's. Returns the gated, normed y
    [rows, heads * head_dim] (None: `out` False)."""
    proj, index, starts, dry = _mixer_rows(proj, slots, starts, dry)
    y = torch.empty(proj.shape[0], heads * head_dim) if out else None
    f32 = [t.float().contiguous() for t in (conv_w, dt_bias, a_log, d, norm_w)]
    bias = None if conv_b is None else conv_b.float().contiguous()
    assert conv_state.is_contiguous() and ssm_state.is_contiguous()
    status = cpu_kernels().loom_mamba2_decode_f32(
        proj.data_ptr(), proj.stride(0), index.ctypes.data, len(index), _ptr(starts), _ptr(dry),
        conv_state.data_ptr(), f32[0].data_ptr(), None if bias is None else bias.data_ptr(),
        ssm_state.data_ptr(), f32[1].data_ptr(), f32[2].data_ptr(), f32[3].data_ptr(),
        f32[4].data_ptr(), heads, head_dim, groups, state_size, conv_w.shape[1], norm_groups,
        int(chunked), eps, dt_min, dt_max, None if y is None else y.data_ptr(),
        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"Mamba2 decode step failed ({status}: no memory for its scratch, "
                           f"or groups that do not divide the heads or the inner channels)")
    return y


def shortconv_decode(proj: torch.Tensor, slots: np.ndarray, window_state: torch.Tensor,
                     conv_w: torch.Tensor, conv_b: torch.Tensor | None,
                     starts: np.ndarray | None = None, dry: np.ndarray | None = None,
                     out: bool = True) -> torch.Tensor | None:
    """LFM2's short convolution's decode step (csrc/shortconv.c): proj [rows, 3 H] fp32
    (in_proj's rows: b, c, h), each request's rows one after another as gdn_decode's, its
    window in window_state [slots, H, width - 1] (fp32, contiguous; updated in place but for
    `dry` requests'). Returns c * (conv(b * h) + conv_b) [rows, H] (None: `out` False)."""
    proj, index, starts, dry = _mixer_rows(proj, slots, starts, dry)
    hidden = conv_w.shape[0]
    y = torch.empty(proj.shape[0], hidden) if out else None
    weight = conv_w.float().contiguous()
    bias = None if conv_b is None else conv_b.float().contiguous()
    assert window_state.is_contiguous() and proj.shape[1] == 3 * hidden
    status = cpu_kernels().loom_shortconv_decode_f32(
        proj.data_ptr(), proj.stride(0), index.ctypes.data, len(index), _ptr(starts), _ptr(dry),
        window_state.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        hidden, conv_w.shape[1], None if y is None else y.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"short convolution decode step failed ({status})")
    return y
