"""Dequantize GGUF tensors to float32, or convert them to Loom's int8 grid.

The 32-wide block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) are unpacked with vectorized
torch ops; every other type the `gguf` package knows (K-quants, other IQ types, BF16 ...) goes
through its reference numpy implementation. Tests check the torch paths against the `gguf`
reference. Those formats and IQ4_XS (whose sub-blocks of 32 are IQ4_NL blocks with a scale of
their own) convert to Loom's int8 grid exactly (`q8_groups`).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from loom.quant.int8 import IQ4, IQ4_Q, Q5, Q8Groups, unpack_fifth_bits, unpack_nibbles, width


class UnsupportedTensorTypeError(ValueError):
    """A GGUF tensor type neither Loom nor the `gguf` package can dequantize."""


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()  # [n, 1]


# 4-bit block formats -> where their 16 bytes of nibbles start in a block
NIBBLE_TYPES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}
# IQ4_NL's levels (ggml's kvalues_iq4nl, -127..113) + 128: 1..241, the grid's IQ4 table (the
# float32 path looks them up; the grid keeps the indices)
IQ4_NL_LEVELS = IQ4_Q.to(torch.int16)


def _unpack(
    qtype: GGMLQuantizationType, blocks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """blocks [n, type_size] uint8 -> (integers [n, 32], d [n, 1], zero, m [n, 1] or None): each
    weight is d * (integer - zero), plus m where the format has one."""
    d = _f16(blocks, 0)
    if qtype in NIBBLE_TYPES:
        q = unpack_nibbles(blocks[:, NIBBLE_TYPES[qtype]:])
        if qtype == GGMLQuantizationType.Q4_0:
            return q, d, 8, None
        return q, d, 0, _f16(blocks, 2)
    if qtype == GGMLQuantizationType.Q8_0:
        return blocks[:, 2:].view(torch.int8), d, 0, None
    if qtype == GGMLQuantizationType.Q5_0:
        return unpack_nibbles(blocks[:, 6:]) | unpack_fifth_bits(blocks[:, 2:6]), d, 16, None
    if qtype == GGMLQuantizationType.Q5_1:
        return (unpack_nibbles(blocks[:, 8:]) | unpack_fifth_bits(blocks[:, 4:8]), d, 0,
                _f16(blocks, 2))
    if qtype == GGMLQuantizationType.IQ4_NL:  # 4-bit indices into 16 levels -127..113, + 128
        return IQ4_NL_LEVELS[unpack_nibbles(blocks[:, 2:]).long()], d, 128, None
    raise AssertionError(qtype)


def _dequant_blocks(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> torch.Tensor:
    """blocks [n, type_size] uint8 -> [n, 32] float32.

    In-place float ops on one fresh buffer keep start-up to a few passes over the weights; the
    order of operations (and so the rounding) is the `gguf` reference's: d * q, then + m.
    """
    q, d, zero, m = _unpack(qtype, blocks)
    w = q.float()
    if zero:
        w.sub_(zero)
    w.mul_(d)
    return w if m is None else w.add_(m)


def _q8_groups_of_blocks(qtype: GGMLQuantizationType, blocks: torch.Tensor, cols: int,
                         five: bool = True) -> Q8Groups:
    """blocks [n, type_size] uint8 of rows `cols` wide -> the int8 grid, one group per block of 32
    (IQ4_XS: per sub-block), exactly: q in 0..255, scale d (IQ4_XS's d (ls - 32), exact in fp32),
    minimum m or -zero x the scale, so q * scale is exact (a small integer times an fp16 d). Q4_0,
    Q4_1, IQ4_NL and IQ4_XS keep their 16 bytes of nibbles a group as they are (4 bits a weight, the
    same order; the IQ4 ones index their levels: the grid's IQ4 form); Q5_0 and Q5_1 keep them too,
    and their fifth bits as a plane after each row's nibbles (the grid's 5-bit form; or, not `five`,
    their values a byte). q comes flat. In one pass of the C kernels' loom_q8_blocks_grid, which the
    grid needs anyway (loom.quant.int8.grouped_available); the float32 path (`dequantize`) is
    torch's."""
    from loom.kernels import cpu_kernels

    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError(f"{qtype.name} onto the int8 grid needs Loom's C kernels")
    block, _ = GGML_QUANT_SIZES[qtype]
    n, bits = blocks.shape[0], group_bits(qtype, five)
    groups = n * block // 32
    blocks = blocks.contiguous()
    q = torch.empty(groups * 32 * width(bits) // 8, dtype=torch.uint8)
    scale, mins = torch.empty(groups, 1), torch.empty(groups, 1)
    rc = lib.loom_q8_blocks_grid(blocks.data_ptr(), n, int(qtype), q.data_ptr(),
                                 scale.data_ptr(), mins.data_ptr(), cols // 32 if five else 0,
                                 torch.get_num_threads())
    assert rc == 0, qtype
    return Q8Groups(q, scale, mins, bits)


TORCH_TYPES = {
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.IQ4_NL,
}


# what converts to the int8 grid exactly: the 32-wide block formats, and IQ4_XS
GRID_TYPES = TORCH_TYPES | {GGMLQuantizationType.IQ4_XS}


def groupable(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether `q8_groups` takes a tensor: 2-D, in a 32-wide block format or IQ4_XS."""
    return qtype in GRID_TYPES and len(shape) == 2


def _blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Raw GGUF data -> [n, type_size] uint8 blocks."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    return _as_torch(np.asarray(data).view(np.uint8)).reshape(-1, type_size)


def q8_groups(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
              five: bool = True) -> Q8Groups | None:
    """Raw GGUF data of a 2-D tensor [rows, cols] in a 32-wide block format or IQ4_XS -> Loom's
    int8 grid (loom.quant.int8), holding the same values `dequantize` gives (q scale + min:
    exactly in real arithmetic; fp32 rounds IQ4_XS's 17-bit scales' products as it rounds
    the reference's); None for other tensors. `five`: Q5_0 / Q5_1 in the grid's 5-bit form,
    else a byte a weight."""
    if not groupable(qtype, shape):
        return None
    rows, cols = shape
    g = _q8_groups_of_blocks(qtype, _blocks(data, qtype), cols, five)
    return Q8Groups(g.q.reshape(rows, -1), g.scale.reshape(rows, cols // 32),
                    g.min.reshape(rows, cols // 32), g.bits)


def group_bits(qtype: GGMLQuantizationType, five: bool = True) -> int:
    """`bits` of `q8_groups`' result for a tensor of `qtype` (a `groupable` type): 4, IQ4
    (nibbles indexing IQ4_NL's levels), Q5 (nibbles and fifth bits, where `five`) or 8."""
    if qtype in (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS):
        return IQ4
    if qtype in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1):
        return Q5 if five else 8
    return 4 if qtype in NIBBLE_TYPES else 8


def _as_torch(a: np.ndarray) -> torch.Tensor:
    """A writable array (Loom's copy-on-write file map) is shared as is; a read-only one (the
    `gguf` package's map) is copied, since torch cannot wrap read-only memory."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor data -> float32 torch tensor of logical (row-major) `shape`."""
    if qtype == GGMLQuantizationType.F32:
        return _as_torch(np.asarray(data, dtype=np.float32)).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return _as_torch(np.asarray(data)).view(torch.float16).float().reshape(shape)
    if qtype in TORCH_TYPES:
        return _dequant_blocks(qtype, _blocks(data, qtype)).reshape(shape)
    try:
        out = gguf_dequantize(data, qtype)
    except NotImplementedError:
        raise UnsupportedTensorTypeError(f"GGUF tensor type {qtype.name} is not supported") from None
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)
