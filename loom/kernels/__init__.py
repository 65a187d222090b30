"""Loom's C kernels for the CPU: the build this process runs and its entry points.

The sources lie in `csrc/`; loom.kernels.build compiles them once per instruction-set variant
(at install, else on first use) and loom.kernels.dispatch chooses which this process loads and
which kernels it runs in it (`select`, else the best for this CPU on first use). OpenMP resolves
to the libgomp torch has already loaded, so kernels and torch share one thread pool.

Where no compiler works, no variant builds, or `LOOM_CPU_KERNELS=0`, `cpu_kernels()` is None and
callers use their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch  # first: the kernels' libgomp must resolve to the one torch loaded

from loom.kernels import dispatch
from loom.kernels.dispatch import KernelChoice

logger = logging.getLogger(__name__)

ENV_SWITCH = dispatch.ENV

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "loom_attention_tiles": (_i64, [_ptr, _i64, _i64, _ptr]),
    "loom_paged_attention_f32": (
        _int,
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
         _i64, _i64, _i64, _i64, _i64, _f32, _f32, _int, _int, _ptr],
    ),
    "loom_linear_q8_f32": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_quantize_q8": (None, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int]),
    "loom_q8_blocks_grid": (_int, [_ptr, _i64, _int, _ptr, _ptr, _ptr, _i64, _int]),
    "loom_linear_q8_amx": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_amx_available": (_int, []),
    "loom_linear_q8_bf16": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_bf16_available": (_int, []),
    "loom_linear_q8_i16": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_i16_available": (_int, []),
    "loom_linear_q8_vnni": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_vnni_available": (_int, []),
    "loom_linear_kq": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _int, _ptr, _i64, _ptr, _i64, _int]
    ),
    "loom_kq_dequant": (None, [_ptr, _int, _i64, _i64, _i64, _ptr, _i64]),
    "loom_kq_isa": (_int, []),
    "loom_kq_check": (_int, [_i64, _int]),
    "loom_kq_r16_available": (_int, []),
    "loom_kq_r16_pack": (None, [_ptr, _i64, _i64, _i64, _ptr, _int]),
    "loom_kq_r16_row": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr]),
    "loom_linear_kq_gemm": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _int, _ptr, _i64, _ptr, _i64, _int]
    ),
    "loom_kq_gemm_isa": (_int, []),
    "loom_decoder_forward_q8": (
        _int, [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _ptr, _i64, _ptr,
               _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
               _ptr, _i64, _ptr, _int, _int, _int]
    ),
    "loom_moe_route_f32": (
        _int, [_ptr, _i64, _i64, _i64, _int, _ptr, _f32, _ptr, _ptr, _ptr, _ptr]
    ),
    "loom_moe_combine_f32": (None, [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int]),
    "loom_moe_scratch_bytes": (_i64, [_i64, _i64, _i64, _i64, _i64]),
    "loom_linear_f32": (None, [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _int]),
    "loom_qk_norm_f32": (None, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _f32, _int]),
    "loom_gelu_tanh_mul_f32": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "loom_add_rms_norm_f32": (None, [_ptr, _ptr, _ptr, _i64, _i64, _f32, _int]),
    "loom_silu_mul_f32": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "loom_sigmoid_mul_f32": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "loom_argmax_rows": (None, [_ptr, _i64, _i64, _i64, _ptr, _int]),
    "loom_gdn_decode_f32": (
        _int, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
               _i64, _i64, _i64, _i64, _int, _int, _f32, _ptr, _int]
    ),
    "loom_mamba2_decode_f32": (
        _int, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
               _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _int, _f32, _f32, _f32, _ptr, _int]
    ),
    "loom_gdn_scratch_floats": (_i64, [_i64, _i64, _i64, _i64, _i64]),
    "loom_mamba2_scratch_floats": (_i64, [_i64, _i64, _i64, _i64, _i64]),
    "loom_shortconv_decode_f32": (
        _int, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _int]
    ),
    "loom_rope_write_kv_f32": (
        None, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int]
    ),
}


KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # the kernels' kv_type


def kv_type(kv_cache: torch.Tensor) -> int:
    """What the C kernels call the cache's dtype (fp32, fp16, or int8 rows: torch_ref)."""
    return KV_TYPES[kv_cache.dtype]


def kv_pointers(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Addresses of K and V in a contiguous cache [2, blocks, block_size, kv_heads, row]."""
    assert kv_cache.is_contiguous()
    k = kv_cache.data_ptr()
    return k, k + kv_cache.numel() // 2 * kv_cache.element_size()


def cpu_flags() -> str:
    """The CPU's feature flags, space-separated (loom.kernels.dispatch.cpu_features)."""
    return " ".join(sorted(dispatch.cpu_features()))


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def _selection(name: str, batch_invariant: bool) -> tuple[ctypes.CDLL, KernelChoice] | None:
    """The library and kernels for --cpu-kernels `name`, built if needed; None where no
    compiler or no variant builds. A variant that fails to build is disabled alone, loudly,
    and "auto" takes the next one down; a named one that fails raises KernelChoiceError."""
    from loom.kernels import build  # not at import: `python -m loom.kernels.build` runs it

    cc = build.compiler()
    if cc is None:
        logger.warning("no C compiler (cc or $CC): CPU kernels off, Loom uses torch ops")
        return None
    failed: set[str] = set()
    while True:
        try:
            choice = dispatch.choose(name, batch_invariant, frozenset(failed))
        except dispatch.KernelChoiceError:
            if name != "auto":
                raise
            logger.warning("no CPU kernel variant built; Loom uses torch ops")
            return None
        try:
            so = build.build(dispatch.variant(choice.variant), cc)
            build.share_torch_libomp()
            lib = _load(so)
        except (build.BuildError, OSError, AttributeError) as e:
            logger.warning("CPU kernels %r DISABLED: %s", choice.variant, e)
            failed.add(choice.variant)
            if name != "auto":
                raise dispatch.KernelChoiceError(
                    f"CPU kernels {name!r} failed to build: {e}") from None
            continue
        return lib, dispatch.granted(choice, amx_tiles=bool(lib.loom_amx_available()))


_current: list[tuple[ctypes.CDLL, KernelChoice] | None] = []  # the selection, once made


def select(name: str = "auto", batch_invariant: bool = False) -> KernelChoice | None:
    """Run the kernels of --cpu-kernels `name` (LOOM_CPU_KERNELS's where `name` is "auto") in
    this process from now on; returns the choice (None: no C kernels, torch ops run).
    KernelChoiceError for a name this CPU or this build cannot run."""
    env = dispatch.requested()
    if env == "0":
        got = None
    else:
        name = env if name == "auto" else name
        if name not in dispatch.NAMES:
            raise dispatch.KernelChoiceError(
                f"unknown CPU kernels {name!r}; choose from {', '.join(dispatch.NAMES)}")
        got = _selection(name, batch_invariant)
    _current[:] = [got]
    return None if got is None else got[1]


def _selected() -> tuple[ctypes.CDLL, KernelChoice] | None:
    if not _current:
        try:
            select()
        except dispatch.KernelChoiceError as e:  # a bad LOOM_CPU_KERNELS: torch paths still work
            logger.warning("CPU kernels unavailable (%s); Loom uses torch ops", e)
            _current[:] = [None]
    return _current[0]


def kernel_choice() -> KernelChoice | None:
    """The kernels this process runs (LOOM_CPU_KERNELS's, or the best, unless select() chose)."""
    got = _selected()
    return None if got is None else got[1]


def cpu_kernels() -> ctypes.CDLL | None:
    """The library of the selected build, built if needed; None when disabled or nothing
    builds."""
    got = _current[0] if _current else _selected()
    return None if got is None else got[0]
