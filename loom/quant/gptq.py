"""INT4 weight-only linears from GPTQ and AWQ checkpoints (group size 128), for the GPU.

Both formats hold, per linear, 4-bit weights packed eight to an int32, per-group scales and
per-group 4-bit zero points packed the same way:
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` gptq): qweight [K / 8, N], packed along the
  input dimension (row k in bits 4 * (k % 8)); qzeros [K / G, N / 8] packed along the output
  (column n in bits 4 * (n % 8)) and stored minus one (w = (q - (z + 1)) * s: the format's
  historical off-by-one); scales [K / G, N]. Only the trivial act-order (g_idx = k // G).
- AWQ (AutoAWQ GEMM): qweight [K, N / 8] and qzeros [K / G, N / 8], both packed along the
  output in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7; w = (q - z) * s; scales [K / G, N].

Both are converted once at load into Loom's canonical layout (the GPTQ qweight packing, zeros
and scales unpacked to [K / G, N] floats), which the Triton dequant-GEMM
(loom/quant/int4_triton.py) reads. Where Triton cannot run, `Int4GptqLinear` dequantizes the
weight at each call (the reference the kernel is tested against).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError

GROUP_SIZE = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble j holds column AWQ_ORDER[j] of its eight
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R / 8, C] int32 packed along rows -> [R, C] int32 values 0..15."""
    q = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)[None, :, None]) & 0xF  # [R/8, 8, C]
    return q.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C / 8] int32 packed along columns -> [R, C] int32 values; `order`: nibble j holds
    column order[j] of its group of eight (AWQ), else column j."""
    q = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [R, C/8, 8] by nibble
    if order is not None:
        q = q[..., torch.argsort(torch.tensor(order))]  # by column
    return q.reshape(packed.shape[0], -1)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> [R / 8, C] int32 (the inverse of unpack_rows)."""
    q = q.to(torch.int32).reshape(-1, 8, q.shape[1])
    return (q << _SHIFTS.to(q.device)[None, :, None]).sum(1, dtype=torch.int32)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A GPTQ linear -> (qweight [K/8, N], scales [G, N], zeros [G, N]) canonical."""
    k = qweight.shape[0] * 8
    group = k // scales.shape[0]
    if g_idx is not None and not torch.equal(
            g_idx.cpu(), torch.arange(k, dtype=g_idx.dtype) // group):
        raise ValueError("GPTQ act-order (desc_act) checkpoints are not supported: g_idx is "
                         "not k // group_size")
    zeros = (unpack_cols(qzeros) + 1).to(scales.dtype)
    return qweight.contiguous(), scales.contiguous(), zeros


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
    """An AWQ (GEMM) linear -> (qweight [K/8, N], scales [G, N], zeros [G, N]) canonical."""
    q = unpack_cols(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_cols(qzeros, AWQ_ORDER).to(scales.dtype)
    return pack_rows(q), scales.contiguous(), zeros


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """Canonical layout -> the weight [K, N] (input rows, output columns) in `dtype`."""
    q = unpack_rows(qweight).float()  # [K, N]
    group = q.shape[0] // scales.shape[0]
    s = scales.float().repeat_interleave(group, 0)
    z = zeros.float().repeat_interleave(group, 0)
    return ((q - z) * s).to(dtype)


def triton_usable(x: torch.Tensor) -> bool:
    """The Triton kernel: on CUDA, or on the CPU in Triton's interpreter (tests)."""
    import importlib.util

    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return (x.device.type == "cuda" or interpreting) and (
        importlib.util.find_spec("triton") is not None)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, block_m: int = 16, block_n: int = 64,
                block_k: int = 32) -> torch.Tensor:
    """x [M, K] @ dequantize(...) [K, N] -> [M, N] in x's dtype, by the Triton kernel."""
    import triton

    from loom.quant.int4_triton import int4_matmul_kernel

    m, k = x.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    if group % block_k or k % block_k:
        raise ValueError(f"int4 GEMM: group {group} and K {k} must be multiples of {block_k}")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    int4_matmul_kernel[grid](
        x, qweight, scales, zeros, out, m, n,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        K=k, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=interpreting and x.dtype == torch.bfloat16,
    )
    return out


class Int4GptqLinear(nn.Module):
    """A linear layer over canonical INT4 weights (from_gptq / from_awq)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [K / 8, N] int32
        self.register_buffer("scales", scales)  # [K / G, N]
        self.register_buffer("zeros", zeros)  # [K / G, N]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = qweight.shape[0] * 8
        self.out_features = qweight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if triton_usable(x2):
            out = int4_matmul(x2, self.qweight, self.scales, self.zeros)
        else:
            out = x2 @ dequantize(self.qweight, self.scales, self.zeros, x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class Int4Checkpoint:
    """A GPTQ or AWQ Hugging Face checkpoint's INT4 linears, loaded into Int4GptqLinear.

    `replace_linears` swaps, on the meta model, every nn.Linear the checkpoint quantizes (a
    packed module such as qkv_proj when its parts are) for an empty Int4GptqLinear;
    `load_stream` takes the qweight / qzeros / scales / g_idx tensors out of the weight stream,
    converts each part, concatenates a packed module's parts along the output and fills the
    module, and yields every other tensor on to the model's own loader."""

    PARTS = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, method: str, group_size: int, quantized: set[str],
                 with_g_idx: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.method = method  # "gptq" or "awq"
        self.group_size = group_size
        self.quantized = quantized  # checkpoint module names holding a qweight
        self.with_g_idx = with_g_idx  # those that also hold a g_idx (GPTQ)

    @classmethod
    def from_folder(cls, folder: Path) -> Int4Checkpoint | None:
        """The folder's INT4 quantization (config.json's quantization_config), or None."""
        import json

        from safetensors import safe_open

        qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
        if not qc or qc.get("quant_method") not in ("gptq", "awq"):
            return None
        method = qc["quant_method"]
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or group != GROUP_SIZE or (method == "awq" and version != "gemm") or (
                method == "gptq" and qc.get("desc_act")):
            raise ConfigError(
                f"{method} checkpoint with bits={bits}, group_size={group}, "
                f"version={version}, desc_act={qc.get('desc_act')}: Loom runs 4-bit, group "
                f"{GROUP_SIZE}, AWQ GEMM and GPTQ without act-order")
        names: set[str] = set()
        g_idx: set[str] = set()
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                names |= {k[: -len(".qweight")] for k in st.keys() if k.endswith(".qweight")}
                g_idx |= {k[: -len(".g_idx")] for k in st.keys() if k.endswith(".g_idx")}
        return cls(method, group, names, g_idx)

    def _target(self, name: str, packed_modules: dict[str, tuple[str, int]]
                ) -> tuple[str, int]:
        """checkpoint module -> (Loom module, shard index)."""
        for frag, (packed, shard) in packed_modules.items():
            if f".{frag}" in name and name.endswith(frag):
                return name[: -len(frag)] + packed, shard
        return name, 0

    def replace_linears(self, model: nn.Module, packed_modules: dict[str, tuple[str, int]]
                        ) -> None:
        """On the meta model: the quantized linears become empty Int4GptqLinear."""
        from loom.quant.base import replace_module

        for name in {self._target(n, packed_modules)[0] for n in self.quantized}:
            linear = model.get_submodule(name)
            if not isinstance(linear, nn.Linear):
                raise ConfigError(f"{self.method} checkpoint quantizes {name}, not a linear")
            k, n = linear.in_features, linear.out_features
            groups = k // self.group_size
            with torch.device("meta"):
                bias = None if linear.bias is None else torch.empty(n)
                module = Int4GptqLinear(torch.empty(k // 8, n, dtype=torch.int32),
                                        torch.empty(groups, n), torch.empty(groups, n), bias)
            replace_module(model, name, module)

    def load_stream(
        self, model: nn.Module, weights: Iterable[tuple[str, Any]],
        packed_modules: dict[str, tuple[str, int]],
    ) -> Iterator[tuple[str, Any]]:
        """Fill the Int4GptqLinear modules from `weights`; yield the other tensors."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        shards: dict[str, dict[int, tuple[torch.Tensor, ...]]] = {}
        need: dict[str, set[int]] = {}  # Loom module -> shards it waits for
        for n in self.quantized:
            target, shard = self._target(n, packed_modules)
            need.setdefault(target, set()).add(shard)
        for name, tensor in weights:
            module_name, _, part = name.rpartition(".")
            if module_name not in self.quantized or part not in self.PARTS:
                yield name, tensor
                continue
            got = parts.setdefault(module_name, {})
            got[part] = tensor
            wanted = {"qweight", "qzeros", "scales"}
            if module_name in self.with_g_idx:
                wanted.add("g_idx")
            if not wanted <= got.keys():
                continue
            target, shard = self._target(module_name, packed_modules)
            if self.method == "gptq":
                canon = from_gptq(got["qweight"], got["qzeros"], got["scales"], got.get("g_idx"))
            else:
                canon = from_awq(got["qweight"], got["qzeros"], got["scales"])
            del parts[module_name]
            shards.setdefault(target, {})[shard] = canon
            if set(shards[target]) == need[target]:
                module = model.get_submodule(target)
                done = shards.pop(target)
                ordered = [done[s] for s in sorted(need[target])]
                for buf, pieces in zip(("qweight", "scales", "zeros"), zip(*ordered)):
                    dst = getattr(module, buf)
                    src = torch.cat(pieces, dim=1)
                    if src.shape != dst.shape:
                        raise ConfigError(f"{target}.{buf}: checkpoint {tuple(src.shape)}, "
                                          f"model {tuple(dst.shape)}")
                    dst.copy_(src)
        if parts or shards:
            raise ConfigError(f"{self.method} checkpoint: incomplete INT4 tensors for "
                              f"{sorted(parts) + sorted(shards)}")
