"""Weight-only INT8.

On the CPU (with Loom's C kernels, `loom/kernels/csrc/linear_q8.c`): 8-bit weights in groups of
32 along the input dimension, each group with an fp32 scale and minimum (255 steps from the
group's least to its greatest weight), fp32 activations and sums. Decode on a CPU is bound by
reading weights: this reads a quarter of fp32's bytes (plus a quarter of that for scales and
minimums). A GGUF 4-bit group (16 levels 15 steps apart) lands exactly on the grid, since
255 = 15 * 17: a Q4_0/Q4_1 model keeps its weights, and keeps them two a byte (GGUF's own
nibbles; see Q8Groups), so decode reads 5 bits a weight (4.5 where each group's minimum is a
fixed multiple of its scale). IQ4_NL and IQ4_XS blocks keep their nibbles too: each indexes
IQ4_NL's 16 levels (`IQ4`). Every output is summed in the same
order whatever the batch, so a request computes the same bits alone as batched.

Elsewhere (CUDA, or no C compiler): per-output-channel int8 weights through torch's
`_weight_int8pack_mm`, which takes and returns bf16.

The kernels beside that one (`fp32`, linear_q8.c's), which loom.kernels.dispatch chooses by
the CPU (`--cpu-kernels`; `--batch-invariant` keeps `fp32` everywhere):

`amx`: products of more than 8 rows (prefill, many streams) run on
AMX tiles (csrc/linear_amx.c) where the CPU has them: q exact in bf16, x split into two bf16
parts, fp32 sums, so fp32's precision, faster than the fp32 kernel at many rows.
Decode of up to 8 rows keeps the kernel above (the AMX entry point runs it). A request's bits
then depend on whether its step had more than 8 rows (the two kernels sum in different orders).

`bf16`: products of more than 8 rows in AVX512-BF16 dot products
(csrc/linear_bf16.c; AMD Zen 4, Intel Cooper Lake and later): each dequantized weight and each x
rounded to bf16, fp32 sums: faster than the fp32 kernel there, at bf16's precision (tested by
top-1 agreement with the fp32 reference, like the other quantized paths). Up to 8 rows as `amx`.

`int16`: products of more than 8 rows in int16 (csrc/linear_kq_gemm.c's tile: AVX2 `vpmaddwd`,
512-bit `vpdpwssd` in the vnni build; the x86 builds without BF16): each
super-block of 256 weights rounded once a call to 13-bit integers, x to 15-bit ones a
super-block, summed exactly in int32; near fp32's top-1 agreement
(docs/cpu_kernels.md). Up to 8 rows as `amx`.

`vnni` (the decode kernel): products of up to 8 rows (decode) in AVX512-VNNI integer
dot products (csrc/linear_vnni.c; Intel Ice Lake, AMD Zen 4 and later): x in two int8 digits a
group of 32 (16 significant bits), the weights as they are, scales and minimums read from fp16
copies (GGUF's own precision; 4 bytes a group more memory, 2 for symmetric groups): a little
faster than the fp32 kernel, near fp32's top-1 agreement (docs/cpu_kernels.md has both
figures). A request's bits then depend on whether its step had more than 8 rows. The AVX2
build runs the same integers in `vpmaddwd`, the AArch64 builds in `sdot` (or widening
multiplies without it), and those past 8 rows too (batch kernel `vnni`: chunks of 8 rows, the
same bits at any batch).

Outputs return in the activations' dtype. Quality is tested against the unquantized reference
by top-1 agreement and a logit-error bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from loom.kernels import cpu_kernels

GROUP = 32
# `bits` of 4-bit nibbles that index IQ4_NL's 16 levels + 128 (IQ4_Q) rather than being the
# values: loom.h's 4 | LOOM_Q8_LEVELS, as the kernels take it
LEVELS = 0x100
IQ4 = 4 | LEVELS
IQ4_Q = torch.tensor([1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241],
                     dtype=torch.uint8)  # ggml's kvalues_iq4nl + 128 (loom.h's loom_iq4_q)
# `bits` of values 0..31 as a row of 4-bit nibbles and a plane of fifth bits (GGUF's Q5_0 and
# Q5_1; see Q8Groups)
Q5 = 5


def width(bits: int) -> int:
    """Bits a stored weight of `bits` (8, 5, 4 or IQ4): loom.h's LOOM_Q8_WIDTH."""
    return bits & 0xFF


# the batch kernel (loom.kernels.dispatch) -> its C entry point (csrc/linear_q8.c, linear_amx.c,
# linear_bf16.c)
BATCH_KERNELS = {"fp32": "loom_linear_q8_f32", "amx": "loom_linear_q8_amx",
                 "bf16": "loom_linear_q8_bf16", "int16": "loom_linear_q8_i16"}
DECODE_ROWS = 8  # up to this many rows a product is decode's (linear_q8.c's M_DIRECT)
# Symmetric groups' zero point by bits (linear_vnni.c's ZERO): Q4_0's 8, Q5_0's 16, Q8_0's and
# the IQ4 levels' 128 as they sit on the grid
ZERO = {4: 8, Q5: 16, 8: 128, IQ4: 128}


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> (uint8 [N, K], fp32 scales and minimums [N, K / 32]):
    w ~ q * scale + min, each group's least weight at 0 and greatest at 255."""
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (hi - lo) / 255.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # constant group: q = 0
    q = torch.round((groups - lo[..., None]) / safe[..., None]).clamp(0, 255).to(torch.uint8)
    return q.view(n, k).contiguous(), scales.contiguous(), lo.contiguous()


def quantize_groups_fast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_groups` in one C pass (the same bits, faster at load)."""
    n, k = w.shape
    wf = w.float().contiguous()
    q = torch.empty((n, k), dtype=torch.uint8)
    scales, mins = torch.empty((n, k // GROUP)), torch.empty((n, k // GROUP))
    cpu_kernels().loom_quantize_q8(wf.data_ptr(), n, k, q.data_ptr(), scales.data_ptr(),
                                   mins.data_ptr(), torch.get_num_threads())
    return q, scales, mins


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes (a GGUF 4-bit group) -> [n, 32] uint8 values: low nibbles are elements
    0..15, high are 16..31."""
    out = torch.empty(qs.shape[0], 2, 16, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[:, 0])
    torch.bitwise_right_shift(qs, 4, out=out[:, 1])
    return out.view(-1, 32)


def unpack_fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, b] bytes (little-endian 32-bit words of GGUF's qh) -> [n, 8 b] uint8: bit j as 0/16
    (numpy's unpackbits, little bit order: bit i of byte b is bit 8b + i). Gemma 3 270M's Q5_0
    layers took ~1.4 s of its start-up when the word was widened to int64 and shifted in torch."""
    bits = np.unpackbits(qh.contiguous().numpy(), axis=1, bitorder="little")
    return torch.from_numpy(bits).bitwise_left_shift_(4)


@dataclass
class Q8Groups:
    """Weights already on the grid above: q [N, K], fp32 scales and minimums [N, K / 32].
    GGUF's 4-, 5- and 8-bit block formats convert to it exactly (loom.quant.gguf_dequant).

    q holds one uint8 per weight (`bits` 8), or, where every q is below 16 (GGUF's Q4_0 and
    Q4_1), two (`bits` 4): q is then uint8 [N, K / 2] in GGUF's order, each group of 32 in 16
    bytes whose low nibbles are its first 16 values and whose high nibbles are its last 16. The
    kernels give the same bits for either: the values are the same. `bits` IQ4: two a byte as
    4, each nibble i standing for the value IQ4_Q[i] (IQ4_NL's and IQ4_XS's indices as stored).
    `bits` 5 (Q5), where every q is below 32 (GGUF's Q5_0 and Q5_1): a row is its values' low
    four bits as `bits` 4 holds them, K / 2 bytes, then their fifth bits, K / 8 bytes: group g's
    as a little-endian 32-bit word at K / 2 + 4 g, bit j standing for 16 in value j (GGUF's qh
    as stored): [N, K * 5 / 8]."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    bits: int = 8

    @classmethod
    def empty(cls, rows: int, cols: int, bits: int = 8) -> Q8Groups:
        return cls(torch.empty((rows, cols * width(bits) // 8), dtype=torch.uint8),
                   torch.empty((rows, cols // GROUP)), torch.empty((rows, cols // GROUP)), bits)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.q.shape[1] * 8 // width(self.bits)))

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Q8Groups:
        """`fn` (an indexing or a permutation of rows) applied to q, scales and minimums."""
        return Q8Groups(fn(self.q), fn(self.scale), fn(self.min), self.bits)

    def rows(self, index: torch.Tensor | slice) -> Q8Groups:
        return self.map_rows(lambda t: t[index])

    def values(self) -> torch.Tensor:
        """q as uint8 [N, K], one value per weight."""
        if self.bits == 8:
            return self.q
        n, k = self.shape
        if self.bits == Q5:
            low = unpack_nibbles(self.q[:, :k // 2].reshape(-1, GROUP // 2)).view(n, k)
            return low | unpack_fifth_bits(self.q[:, k // 2:])
        q = unpack_nibbles(self.q.reshape(-1, GROUP // 2)).view(n, k)
        return IQ4_Q[q.long()] if self.bits == IQ4 else q

    def to_bits(self, bits: int) -> Q8Groups:
        """The same values in `bits` per weight; 4 needs every q below 16, 5 below 32, and IQ4
        comes only from IQ4 (ValueError)."""
        if bits == self.bits:
            return self
        q = self.values()
        if bits == 8:
            return Q8Groups(q, self.scale, self.min)
        if IQ4 in (bits, self.bits):
            raise ValueError("IQ4 level indices come only from IQ4_NL / IQ4_XS blocks")
        levels = 1 << width(bits)
        if bool((q >= levels).any()):
            raise ValueError(f"weights have more than {levels} levels per group: they need "
                             "more bits")
        n, k = q.shape
        v = q.reshape(n, k // 32, 2, 16) & 15
        low = (v[:, :, 0] | v[:, :, 1] << 4).reshape(n, k // 2)
        if bits == 4:
            return Q8Groups(low, self.scale, self.min, 4)
        high = np.packbits((q >> 4).numpy(), axis=1, bitorder="little")
        return Q8Groups(torch.cat([low, torch.from_numpy(high)], dim=1), self.scale, self.min,
                        Q5)

    def dequantize(self, index: torch.Tensor | slice | None = None) -> torch.Tensor:
        """fp32 weights (rows `index`): q * scale + min. The kernels fuse the multiply-add; the
        values agree wherever q * scale is exact, as for every GGUF block format."""
        g = self if index is None else self.rows(index)
        n, k = g.shape
        w = g.values().float().view(n, k // GROUP, GROUP)
        return w.mul_(g.scale[..., None]).add_(g.min[..., None]).view(n, k)


def grouped_available(device: torch.device, in_features: int) -> bool:
    """Whether Loom's grouped int8 kernel takes a layer with `in_features` inputs on `device`."""
    return device.type == "cpu" and in_features % GROUP == 0 and cpu_kernels() is not None


class _OnGrid:
    """Buffers weight_int8 / scale / min on the grid, filled row ranges at a time at load."""

    weight_int8: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    bits: int
    # Every group's minimum is -ZERO[bits] times its scale (drop_symmetric_mins): `min` is
    # empty, the kernels form each minimum from its scale (loom.h's loom_q8_min)
    symmetric = False

    def _hold(self, groups: Q8Groups) -> None:
        self.bits = groups.bits  # per stored weight: 8, 5, or 4 or IQ4 (see Q8Groups)
        self.register_buffer("weight_int8", groups.q)  # type: ignore[attr-defined]
        self.register_buffer("scale", groups.scale)  # type: ignore[attr-defined]
        self.register_buffer("min", groups.min)  # type: ignore[attr-defined]

    @property
    def groups(self) -> Q8Groups:
        """The buffers themselves (load_rows fills them in place), a symmetric layer's minimums
        formed."""
        mins = self.scale * -ZERO[self.bits] if self.symmetric else self.min
        return Q8Groups(self.weight_int8, self.scale, mins, self.bits)

    def group_rows(self, index: torch.Tensor | slice) -> Q8Groups:
        """Rows `index` of the groups (a symmetric layer's minimums formed for those rows only)."""
        scale = self.scale[index]
        mins = scale * -ZERO[self.bits] if self.symmetric else self.min[index]
        return Q8Groups(self.weight_int8[index], scale, mins, self.bits)

    @property
    def min_ptr(self) -> int | None:
        """The fp32 minimums as the C kernels take them: None for symmetric groups."""
        return None if self.symmetric else self.min.data_ptr()

    def drop_symmetric_mins(self) -> bool:
        """Once loaded: where every group's minimum is -ZERO[bits] times its scale, exactly (a
        file's Q4_0, Q5_0, Q8_0, IQ4_NL and IQ4_XS blocks on the grid), free the fp32 minimums
        (4 bytes a group: ~1 bit a weight) and let the kernels form them. Returns whether it
        did. The same floats either way, so the same bits."""
        if self.symmetric:
            return True
        zero = ZERO.get(self.bits)
        if zero is None or self.min.numel() == 0 or not torch.equal(self.min,
                                                                     self.scale * -zero):
            return False
        self.min = torch.empty(0)  # the registered buffer's new value
        self.symmetric = True
        return True

    def load_rows(self, rows: slice | None, w: torch.Tensor | Q8Groups) -> int:
        """Fill rows `rows` (all when None) from a checkpoint tensor: grouped weights are
        copied as they are, float ones quantized. Returns the row count."""
        dest = self.groups if rows is None else self.groups.rows(rows)
        if tuple(w.shape) != tuple(dest.shape):
            raise ValueError(f"shape {tuple(w.shape)}, expected {tuple(dest.shape)}")
        src = w if isinstance(w, Q8Groups) else Q8Groups(*quantize_groups_fast(w))
        src = src.to_bits(dest.bits)
        pairs = list(zip((dest.q, dest.scale, dest.min), (src.q, src.scale, src.min)))
        if rows is None and all(a.dtype == b.dtype and a.shape == b.shape and b.is_contiguous()
                                and a.device == b.device for a, b in pairs):
            # the whole tensor: the buffers take the converted tensors' memory rather than a
            # copy (a second table meanwhile: 160 MiB for Gemma 3's embedding). set_ keeps the
            # buffer objects, which a tied output projection holds too.
            for a, b in pairs:
                a.set_(b)
            return dest.shape[0]
        for a, b in pairs:
            a.copy_(b)
        return dest.shape[0]


class Int8Embedding(_OnGrid, nn.Module):
    """Token embeddings on the int8 grid, rows dequantized as they are looked up. From GGUF's
    block formats they hold the file's values exactly (the fp32 reference's embeddings, bit for
    bit) in about a third of fp32's bytes; a tied output projection shares the tensors."""

    grouped = True  # always on the grid (an Int8Linear may be per-channel bf16 instead)

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int = 8) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._hold(Q8Groups.empty(num_embeddings, embedding_dim, bits))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.group_rows(input_ids).dequantize()  # [num_tokens, embedding_dim]


class Int8Linear(_OnGrid, nn.Module):
    # The kernel for products of more than 8 rows: "fp32" (linear_q8.c, the same bits whatever
    # the batch), "amx", "bf16", "int16" or "vnni" (the decode kernel in chunks of 8 rows: the
    # AArch64 builds'; see the module doc). Set by the loader.
    batch_kernel = "fp32"
    # fp16 copies of the scales and minimums: set (by use_vnni), products of up to 8 rows run
    # on the VNNI kernel (decode_kernel "vnni"), which reads them; the minimums None where
    # every group's is -ZERO[bits] times its scale (the kernel takes them from the scales)
    _half: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # Write every output into one buffer kept across calls (grown as needed): each result is
    # then valid only until the next call. The loader sets it on the output projection, whose
    # logits (vocab x rows: tens of MB at many rows) the runner consumes within its step; a
    # fresh buffer that size would be page-faulted in on every step.
    reuse_output = False
    _out: torch.Tensor | None = None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.grouped = grouped_available(w.device, self.in_features)
        if self.grouped:  # uint8 [out, in]; fp32 scales and minimums [out, in / 32]
            self._hold(Q8Groups(*quantize_groups_fast(w)))
        else:
            self.bits = 8
            w = w.float()
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("weight_int8", q)
            self.register_buffer("scale", scale.to(torch.bfloat16))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(
            bias.detach().float().clone() if self.grouped else bias.detach().clone(),
            requires_grad=False,
        )
        self.out_dtype = linear.weight.dtype

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool,
              groups: Q8Groups | None = None, bits: int = 8) -> Int8Linear:
        """A grouped layer (CPU) whose weights `load_rows` fills from a checkpoint, without an
        fp32 copy, `bits` a weight; or one over `groups`' tensors, shared (a tied output
        projection)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = in_features, out_features
        m.grouped, m.out_dtype = True, torch.float32
        m._hold(Q8Groups.empty(out_features, in_features, bits) if groups is None else groups)
        m.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        return m

    def use_vnni(self) -> None:
        """Run products of up to 8 rows on linear_vnni.c, which reads fp16 copies of the
        scales and minimums (exact for GGUF's blocks, which store them in fp16; rounded to
        fp16 otherwise: 4 bytes a group beside the fp32 ones, 2 for symmetric groups)."""
        assert self.grouped
        scale = self.scale.to(torch.float16)
        mins = None if self.symmetric else self.min.to(torch.float16)
        # Symmetric groups (Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS files): the kernel forms each minimum
        # from its scale, the same fp16 value (checked here), and reads 2 bytes a group fewer
        if mins is not None and torch.equal(mins.float(), scale.float() * -ZERO[self.bits]):
            mins = None
        self._half = (scale, mins)

    @property
    def decode_kernel(self) -> str:
        """The kernel for products of up to 8 rows (decode): "fp32" (linear_q8.c's direct path)
        or "vnni" (linear_vnni.c; see the module doc)."""
        return "fp32" if self._half is None else "vnni"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.grouped:
            xf = x2.float()
            if xf.stride(-1) != 1:
                xf = xf.contiguous()
            out = self._output(xf.shape[0])
            if self._half is not None and (xf.shape[0] <= DECODE_ROWS
                                           or self.batch_kernel == "vnni"):
                name, (scale, mins) = "loom_linear_q8_vnni", self._half
                mins_ptr = None if mins is None else mins.data_ptr()
            else:  # the AMX and bf16 entry points run the fp32 kernel themselves up to 8 rows
                name, scale, mins_ptr = BATCH_KERNELS[self.batch_kernel], self.scale, self.min_ptr
            rc = getattr(cpu_kernels(), name)(
                xf.data_ptr(), xf.shape[0], self.in_features, xf.stride(0),
                self.weight_int8.data_ptr(), scale.data_ptr(), mins_ptr,
                None if self.bias is None else self.bias.data_ptr(),
                self.out_features, out.data_ptr(), self.out_features, self.bits,
                torch.get_num_threads(),
            )
            if rc != 0:
                raise RuntimeError(
                    f"int8 linear kernel failed ({rc}: -1 bad K={self.in_features}, -2 no memory, "
                    "-3 no AMX, AVX512-BF16 or AVX512-VNNI)"
                )
            return out.reshape(*shape[:-1], self.out_features).to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(
            x2.to(torch.bfloat16), self.weight_int8, self.scale
        ).to(self.out_dtype)  # [num_tokens, out]
        out = out.reshape(*shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias

    def _output(self, rows: int) -> torch.Tensor:
        if not self.reuse_output:
            return torch.empty((rows, self.out_features), dtype=torch.float32)
        if self._out is None or self._out.shape[0] < rows:
            self._out = torch.empty((rows, self.out_features), dtype=torch.float32)
        return self._out[:rows]

    def extra_repr(self) -> str:
        kind = ("4-bit IQ4_NL level indices" if self.bits == IQ4 else f"{self.bits}-bit values")
        mins = "minimums -ZERO x scale" if self.symmetric else "fp32 minimums"
        kind = (f"{kind} in groups of 32, fp32 scales, {mins}"
                if self.grouped else "per channel, bf16")
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({kind})"
