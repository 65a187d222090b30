"""Small C kernels for the CPU, compiled on first use with the machine's C compiler and cached.

The source lies in `csrc/`. It is built with `-O3 -march=native -ffast-math -fopenmp` into
`$LOOM_CACHE_DIR/kernels` (default `~/.cache/loom/kernels`), under a name that hashes the source,
the flags, the compiler's version and the CPU's feature flags, so a changed source or machine
rebuilds and a warm machine loads in milliseconds. OpenMP resolves to the libgomp torch has
already loaded, so kernels and torch share one thread pool.

Where no compiler works, or `LOOM_CPU_KERNELS=0`, `cpu_kernels()` is None and callers use their
torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # first: the kernels' libgomp must resolve to the one torch loaded

logger = logging.getLogger(__name__)

ENV_SWITCH = "LOOM_CPU_KERNELS"
SOURCES = ("paged_attention.c", "layer_ops.c", "linear_q8.c", "linear_amx.c", "linear_bf16.c",
           "linear_vnni.c", "decoder_q8.c")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "loom_attention_tiles": (_i64, [_ptr, _i64, _i64, _ptr]),
    "loom_paged_attention_f32": (
        _int,
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
         _i64, _i64, _i64, _i64, _i64, _f32, _int, _int, _ptr],
    ),
    "loom_linear_q8_f32": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_quantize_q8": (None, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int]),
    "loom_linear_q8_amx": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_amx_available": (_int, []),
    "loom_linear_q8_bf16": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_bf16_available": (_int, []),
    "loom_linear_q8_vnni": (
        _int, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _int]
    ),
    "loom_vnni_available": (_int, []),
    "loom_llama_forward_q8": (
        _int, [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _ptr, _i64,
               _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr,
               _ptr, _ptr, _ptr, _ptr, _i64, _int, _int, _int]
    ),
    "loom_add_rms_norm_f32": (None, [_ptr, _ptr, _ptr, _i64, _i64, _f32, _int]),
    "loom_silu_mul_f32": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "loom_argmax_rows": (None, [_ptr, _i64, _i64, _i64, _ptr, _int]),
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


def cache_dir() -> Path:
    root = os.environ.get("LOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loom"
    )
    return Path(root) / "kernels"


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line (the CPU's features; also in the kernels' cache key)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return cc if shutil.which(cc) else None


def _build(cc: str, sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    base = [cc, *CFLAGS, *map(str, sources), "-o", tmp]
    try:
        # libmvec holds the vector expf that -ffast-math loops call; not every libc has it.
        for libs in (["-lmvec", "-lm"], ["-lm"]):
            proc = subprocess.run([*base, *libs], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp, target)  # atomic: concurrent builders each write their own tmp
                return
        raise RuntimeError(f"{cc} failed:\n{proc.stderr[-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    """The compiled kernels, built if needed; None when disabled or no compiler can build them."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler (cc or $CC): CPU kernels off, Loom uses torch ops")
        return None
    sources = [Path(__file__).parent / "csrc" / s for s in SOURCES]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256()
        for part in (*[s.read_bytes() for s in sources], " ".join(CFLAGS).encode(),
                     version.encode(), cpu_flags().encode(), torch.__version__.encode()):
            key.update(part)
        target = cache_dir() / f"loom_cpu_{key.hexdigest()[:16]}.so"
        if not target.exists():
            logger.info("building CPU kernels into %s", target)
            _build(cc, sources, target)
            for old in target.parent.glob("loom_cpu_*.so"):  # other sources, flags or CPUs
                if old != target:
                    old.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
        return _load(target)
    except Exception as e:  # a broken toolchain must not stop serving: torch paths still work
        logger.warning("CPU kernels unavailable (%s); Loom uses torch ops", e)
        return None
