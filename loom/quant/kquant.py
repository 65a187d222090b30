"""GGUF's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) kept as the file stores them, run on Loom's C
kernels.

A K-quant tensor is rows of 256-weight super-blocks (`KBlocks`: the raw bytes, [rows, K / 256 *
block bytes]); `KQuantLinear` holds a linear layer's weights so, one part per checkpoint tensor
(a fused qkv or gate_up projection keeps each source's own format: a Q4_K_M file mixes Q4_K and
Q6_K, and Q5_0 / Q8_0 where a width is not a multiple of 256), and multiplies on
`csrc/linear_kquant.c`: x quantized once a call in two int8 digits a run of 16 values, integer
dot products against the blocks, fp32 scales (the kernel's accuracy and speed:
docs/kquants.md); past 8 rows `csrc/linear_kq_gemm.c` by default (panels of weight rows
unpacked once a call: bf16, int16 or fp32 products). Parts on Loom's int8 grid run as
`Int8Linear`s, float parts in fp32. On AVX512-VNNI builds the loader interleaves Q4_K parts 16
rows at a time (`KBlocks.interleave`): the kernel then takes a step of a few rows in about half
the instructions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from loom.kernels import cpu_kernels
from loom.quant.int8 import Int8Linear, Q8Groups

QK = 256  # weights a super-block
# the formats the kernel runs -> its code (ggml's type id)
KQ_TYPES = {GGMLQuantizationType.Q2_K: 10, GGMLQuantizationType.Q3_K: 11,
            GGMLQuantizationType.Q4_K: 12, GGMLQuantizationType.Q5_K: 13,
            GGMLQuantizationType.Q6_K: 14}


R16 = 0x200  # loom.h's LOOM_KQ_R16: Q4_K rows interleaved 16 at a time
R16_INT_ROWS = 32  # loom.h's LOOM_KQ_R16_INT_ROWS: their integer kernel's most rows
GROUP_ROWS = 16


def native(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor can stay in blocks here: 2-D, in a format KQ_TYPES names."""
    return qtype in KQ_TYPES and len(shape) == 2 and shape[1] % QK == 0


@dataclass
class KBlocks:
    """A 2-D K-quant tensor [rows, cols] as stored: `data` uint8 [rows, cols / 256 * block
    bytes], each row its super-blocks in order; or, `interleaved`, Q4_K rows 16 at a time (the
    same bytes rearranged within each group of 16 rows: `interleave`)."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    cols: int
    interleaved: bool = False

    @classmethod
    def from_gguf(cls, data: np.ndarray, qtype: GGMLQuantizationType,
                  shape: tuple[int, ...]) -> KBlocks:
        rows, cols = shape
        raw = np.asarray(data).view(np.uint8)
        t = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
        return cls(t.reshape(rows, -1), qtype, cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def fmt(self) -> int:
        return KQ_TYPES[self.qtype] | (R16 if self.interleaved else 0)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KBlocks:
        """`fn` (an indexing or permutation of rows) applied to the rows: each is whole."""
        if self.interleaved:
            raise ValueError("interleaved K-quant rows move 16 at a time: map rows before")
        return KBlocks(fn(self.data), self.qtype, self.cols)

    def can_interleave(self) -> bool:
        """Whether `interleave` applies: Q4_K, whole groups of 16 rows, a build with the
        interleaved kernel (AVX512-VNNI: csrc/linear_kquant.c)."""
        lib = cpu_kernels()
        return (not self.interleaved and self.qtype == GGMLQuantizationType.Q4_K
                and self.data.shape[0] % GROUP_ROWS == 0 and lib is not None
                and bool(lib.loom_kq_r16_available()))

    def interleave(self) -> KBlocks:
        """The same weights with Q4_K rows interleaved 16 at a time: each 64 bytes the decode
        kernel reads hold 8 weights of 16 rows, so past one x row it takes ~2x fewer
        instructions a weight (docs/kquants.md). Bytes and shape are unchanged; the
        products' bits are the interleaved kernel's up to 32 rows, past them the GEMM's on the
        stored blocks."""
        data = self.data.contiguous()
        out = torch.empty_like(data)
        cpu_kernels().loom_kq_r16_pack(data.data_ptr(), self.cols, 0,
                                       data.shape[0] // GROUP_ROWS, out.data_ptr(),
                                       torch.get_num_threads())
        return KBlocks(out, self.qtype, self.cols, True)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols]: the `gguf` package's values bit for bit (C where built)."""
        rows, cols = self.shape
        lib = cpu_kernels()
        if lib is None:  # (interleaved blocks exist only where the kernels are)
            from gguf.quants import dequantize

            out = dequantize(self.data.numpy(), self.qtype)
            return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(rows, cols)
        data = self.data.contiguous()
        out = torch.empty((rows, cols), dtype=torch.float32)
        lib.loom_kq_dequant(data.data_ptr(), self.fmt, cols, 0, rows, out.data_ptr(), cols)
        return out


def bytes_per_weight(qtype: GGMLQuantizationType) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return size / block


class KQuantLinear(nn.Module):
    """A linear layer over K-quant blocks, filled part by part at load (`load_rows`: each
    checkpoint tensor keeps its own format; int8-grid parts become `Int8Linear`s, float parts
    fp32). Products run on linear_kquant.c, past 8 rows on `batch_kernel`'s (see the module
    doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # row start -> (rows, the part: KBlocks, an Int8Linear or fp32 weights [rows, in]), in
        # row order (load_rows keeps it sorted: forward walks it every call)
        self.parts: dict[int, tuple[int, KBlocks | Int8Linear | torch.Tensor]] = {}
        # what loom.models.weight_map counts rows by (a layer filled by load_rows)
        self.weight_int8 = torch.empty((out_features, 0), dtype=torch.uint8)
        # the kernel past 8 rows (loom.kernels.dispatch's Variant.kquant_batch; the loader sets
        # it): "int" linear_kquant.c's at every size (batch-invariant), "bf16" / "int16" / "fp32"
        # linear_kq_gemm.c's
        self.batch_kernel = "int"
        # False where the blocks are another module's too (a tied head: the embedding's)
        self.owns_blocks = True

    def load_rows(self, rows: slice | None, w: torch.Tensor | Q8Groups | KBlocks) -> int:
        """Take rows `rows` (all when None) from checkpoint tensor `w` in its own format."""
        start = 0 if rows is None else rows.start
        n = self.out_features if rows is None else rows.stop - rows.start
        if tuple(w.shape) != (n, self.in_features):
            raise ValueError(f"shape {tuple(w.shape)}, expected {(n, self.in_features)}")
        if isinstance(w, KBlocks):
            part: KBlocks | Int8Linear | torch.Tensor = KBlocks(w.data.contiguous(), w.qtype,
                                                                w.cols)
        elif isinstance(w, Q8Groups):
            part = Int8Linear.empty(self.in_features, n, False, bits=w.bits)
            part.load_rows(None, w)
            self.add_module(f"part{start}", part)  # the loader sets its kernels
        else:
            part = w.float().contiguous()
        self.parts = dict(sorted({**self.parts, start: (n, part)}.items()))
        return n

    def interleave(self, before: Callable[[torch.Tensor], object] | None = None,
                   after: Callable[[torch.Tensor], object] | None = None) -> int:
        """Interleave the Q4_K parts that can be (KBlocks.interleave) where the blocks are this
        layer's own, one at a time: `before` and `after` see each part's stored blocks (the
        loader maps a file's pages in before and drops them after); returns how many were."""
        if not self.owns_blocks:
            return 0
        done = 0
        for start, (rows, p) in list(self.parts.items()):
            if isinstance(p, KBlocks) and p.can_interleave():
                if before is not None:
                    before(p.data)
                self.parts[start] = (rows, p.interleave())
                if after is not None:
                    after(p.data)
                done += 1
        return done

    def formats(self) -> list[str]:
        """Each part's format, in row order (e.g. ['Q4_K', 'Q4_K', 'Q6_K'])."""
        return [p.qtype.name if isinstance(p, KBlocks) else
                f"int8 grid ({p.bits}-bit)" if isinstance(p, Int8Linear) else "fp32"
                for _, p in self.parts.values()]

    def weight_bytes(self) -> int:
        """Bytes the weights take in memory."""
        total = 0
        for _, p in self.parts.values():
            if isinstance(p, KBlocks):
                total += p.data.numel()
            elif isinstance(p, Int8Linear):
                total += sum(t.numel() * t.element_size() for t in p.buffers())
            else:
                total += p.numel() * 4
        return total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1]).float()
        if xf.stride(-1) != 1 or xf.stride(0) != self.in_features:
            xf = xf.contiguous()
        m, n = xf.shape[0], self.out_features
        out = torch.empty((m, n), dtype=torch.float32)  # [num_tokens, out]
        for start, (rows, p) in self.parts.items():
            if isinstance(p, KBlocks):
                bias = 0 if self.bias is None else self.bias.data_ptr() + 4 * start
                lib = cpu_kernels()
                rc = (lib.loom_linear_kq if self.batch_kernel == "int" else
                      lib.loom_linear_kq_gemm)(
                    xf.data_ptr(), m, self.in_features, self.in_features, p.data.data_ptr(),
                    p.fmt, bias or None, rows, out.data_ptr() + 4 * start, n,
                    torch.get_num_threads())
                if rc != 0:
                    raise RuntimeError(f"K-quant linear kernel failed ({rc}: -1 bad K="
                                       f"{self.in_features} or format, -2 no memory)")
                continue
            part = p(xf) if isinstance(p, Int8Linear) else F.linear(xf, p)  # [num_tokens, rows]
            if self.bias is not None:
                part = part + self.bias[start:start + rows]
            out[:, start:start + rows] = part
        return out.reshape(*shape[:-1], n).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={'+'.join(self.formats())}")
