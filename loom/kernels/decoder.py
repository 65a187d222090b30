"""The whole decoder stack of an int8 Llama-family model in one C call (csrc/decoder_q8.c).

It runs the kernels the per-module path runs, in the same order, on the same buffers' values:
the same bits, without Python between ~300 kernel calls a step. It applies when every layer's
linears are int8 on Loom's kernel, activations are fp32 on the CPU, attention runs on the C
kernel and the model has no q/k norm; otherwise the model keeps its per-module path. With
`--int8-batch-kernel amx` (or `bf16`) its linears run on AMX tiles (bf16 dot products) in steps
of more than 8 rows, as the modules' do (loom.quant.int8).
"""

from __future__ import annotations

import ctypes

import torch

from loom.attention.backends import cpu_kernel
from loom.attention.forward_context import get_forward_context
from loom.kernels import cpu_kernels, kv_pointers, kv_type
from loom.quant.int8 import Int8Linear

BATCH_CODES = {"avx": 0, "amx": 1, "bf16": 2}  # decoder_q8.c's `kernel`, low bits
DECODE_VNNI = 4  # its flag for decode_kernel "vnni"


class LinearQ8(ctypes.Structure):  # decoder_q8.c's LoomLinearQ8
    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "s", "m", "s16", "m16")] + [
        ("bits", ctypes.c_int64)]

    @classmethod
    def of(cls, linear: Int8Linear) -> LinearQ8:
        half = (None, None) if linear._half is None else (t.data_ptr() for t in linear._half)
        return cls(linear.weight_int8.data_ptr(), linear.scale.data_ptr(),
                   linear.min.data_ptr(), *half, linear.bits)


class LayerQ8(ctypes.Structure):  # decoder_q8.c's LoomLayerQ8
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "in_norm", "post_norm", "qkv_b", "k_cache", "v_cache",
    )] + [(name, LinearQ8) for name in ("qkv", "o", "gu", "d")] + [("window", ctypes.c_int64)]


def _linears(layer: torch.nn.Module) -> tuple[Int8Linear, Int8Linear, Int8Linear, Int8Linear]:
    """A layer's linears in LayerQ8's order: qkv, o, gate_up, down."""
    a, mlp = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj


def _grouped(m: object, bias_ok: bool = False) -> bool:
    return isinstance(m, Int8Linear) and m.grouped and (bias_ok or m.bias is None)


def eligible(model: torch.nn.Module) -> bool:
    """`model` is a LlamaModel whose layers the C stack can run (weights only; the step's
    activations and cache are checked per call)."""
    return (
        not model.layers[0].self_attn.qk_norm
        and all(
            _grouped(layer.self_attn.qkv_proj, bias_ok=True) and _grouped(layer.self_attn.o_proj)
            and _grouped(layer.mlp.gate_up_proj) and _grouped(layer.mlp.down_proj)
            for layer in model.layers
        )
        and cpu_kernels() is not None
    )


class Q8Decoder:
    """Built once per model; `forward` per step. Holds no tensors of its own: pointers into the
    model's parameters and KV caches, rebuilt if the caches are rebound."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        attn0 = model.layers[0].self_attn
        self.num_heads, self.kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_dim = attn0.head_dim
        self.hidden = model.norm.weight.shape[0]
        self.inter = model.layers[0].mlp.intermediate_size
        self.eps = model.norm.eps
        self.scale = attn0.attn.scale
        self.layers: ctypes.Array | None = None
        self.cache_ptr = 0
        self.code = 0  # decoder_q8.c's `kernel`, set with the layers
        self.scratch: list[torch.Tensor] = []  # the stack's activations, kept across steps

    def usable(self, x: torch.Tensor) -> bool:
        return cpu_kernel.supported(
            x, self._cache(), self.num_heads, self.kv_heads, self.head_dim
        )

    def _build(self) -> None:
        rows = []
        for layer in self.model.layers:
            a = layer.self_attn
            rows.append(LayerQ8(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                None if a.qkv_proj.bias is None else a.qkv_proj.bias.data_ptr(),
                *kv_pointers(a.attn.kv_cache), *map(LinearQ8.of, _linears(layer)),
                a.attn.sliding_window or 0,
            ))
        self.layers = (LayerQ8 * len(rows))(*rows)
        # VNNI only where every linear has its fp16 copies (the loader sets all or none)
        linears = [m for layer in self.model.layers for m in _linears(layer)]
        vnni = all(m.decode_kernel == "vnni" for m in linears)
        self.code = BATCH_CODES[linears[0].batch_kernel] | (DECODE_VNNI if vnni else 0)
        self.cache_ptr = self._cache().data_ptr()

    def _cache(self) -> torch.Tensor:
        return self.model.layers[0].self_attn.attn.kv_cache

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] embeddings (overwritten: the residual stream) -> final-normed
        hidden states [num_tokens, hidden], for the step in the forward context."""
        rotary = self.model.rotary_emb
        rotary.check_positions(positions)
        md = get_forward_context().attn_metadata
        cache = self._cache()
        if self.layers is None or self.cache_ptr != cache.data_ptr():
            self._build()
        m, h, i = x.shape[0], self.hidden, self.inter
        qkv_n = (self.num_heads + 2 * self.kv_heads) * self.head_dim
        buf_h = torch.empty((m, h))
        widths = (qkv_n, self.num_heads * self.head_dim, 2 * i, i)
        if not self.scratch or self.scratch[0].shape[0] < m:
            # grown, never shrunk: a fresh allocation each step was page-faulted in again
            self.scratch = [torch.empty((m, n)) for n in widths]
        scratch = [t[:m] for t in self.scratch]
        tiles = cpu_kernel.step_tiles(md, self.num_heads, self.head_dim)
        assert x.is_contiguous() and positions.dtype == torch.int64 and positions.is_contiguous()
        rc = cpu_kernels().loom_llama_forward_q8(
            ctypes.addressof(self.layers), len(self.layers), self.model.norm.weight.data_ptr(),
            h, i, self.num_heads, self.kv_heads, self.head_dim, cache.shape[2],
            self.eps, self.scale, rotary.cos_sin_cache.data_ptr(), m, x.data_ptr(),
            positions.data_ptr(),
            md.slot_mapping.data_ptr(), md.block_tables.data_ptr(), md.block_tables.shape[1],
            tiles.ctypes.data, tiles.shape[0], buf_h.data_ptr(),
            *(t.data_ptr() for t in scratch), torch.get_num_threads(),
            kv_type(cache), self.code,
        )
        if rc != 0:
            raise RuntimeError(f"int8 decoder kernel failed ({rc})")
        return buf_h
