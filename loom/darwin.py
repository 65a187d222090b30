"""What macOS says about the machine through sysctl, where Linux's /proc has it: the CPU's
features and its performance cores. Every function answers None (or nothing) on other
systems, so callers ask without checking the platform first."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

Read = Callable[[str], "int | str | None"]

# machdep.cpu.features / leaf7_features names (Intel Macs) that /proc/cpuinfo spells otherwise;
# the rest are the same lower-cased (AVX2 -> avx2, FMA -> fma, AVX512BW -> avx512bw)
_X86_NAMES = {"AVX1.0": "avx", "SSE4.1": "sse4_1", "SSE4.2": "sse4_2",
              "AVX512VNNI": "avx512_vnni", "AVX512BF16": "avx512_bf16"}
# hw.optional keys of Apple Silicon -> /proc/cpuinfo's AArch64 Features names
_ARM_KEYS = {"hw.optional.arm.FEAT_DotProd": "asimddp", "hw.optional.arm.FEAT_FP16": "asimdhp",
             "hw.optional.arm.FEAT_I8MM": "i8mm", "hw.optional.arm.FEAT_BF16": "bf16"}


# int sysctlbyname(const char *name, void *oldp, size_t *oldlenp, void *newp, size_t newlen)
SYSCTLBYNAME = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_size_t)


@functools.cache
def _sysctlbyname():  # -> libc's sysctlbyname, or None off macOS
    if sys.platform != "darwin":
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "sysctlbyname", None)
    return None if fn is None else SYSCTLBYNAME(ctypes.cast(fn, ctypes.c_void_p).value)


def sysctl(name: str, fn: Callable[..., int] | None = None) -> int | str | None:
    """sysctl `name`'s value: text for the machdep.cpu keys (feature lists, the brand), a
    number (4 or 8 bytes) for the others; None where there is no such key, or no sysctl.
    `fn`: the sysctlbyname to call (default: libc's)."""
    fn = fn or _sysctlbyname()
    if fn is None:
        return None
    key, size = name.encode(), ctypes.c_size_t(0)
    if fn(key, None, ctypes.byref(size), None, 0) != 0:  # the value's size
        return None
    buf = ctypes.create_string_buffer(max(size.value, 1))
    if fn(key, ctypes.cast(buf, ctypes.c_void_p), ctypes.byref(size), None, 0) != 0:
        return None
    raw = buf.raw[:size.value]
    if name.startswith("machdep.cpu."):
        return raw.rstrip(b"\0").decode(errors="replace")
    return int.from_bytes(raw, "little", signed=True) if len(raw) in (4, 8) else None


def cpu_features(machine: str, read: Read = sysctl) -> frozenset[str]:
    """The CPU's features in /proc/cpuinfo's names (loom.kernels.dispatch's Variant.needs), from
    sysctl: Intel Macs' machdep.cpu feature lists, Apple Silicon's hw.optional flags. Every
    Apple Silicon core has NEON and dot products (M1 on: Armv8.4-A); macOS 11 has no
    FEAT_DotProd key yet, so there hw.optional.arm64 stands for it. Empty off macOS."""
    if machine == "aarch64":
        if read("hw.optional.arm64") != 1 and read("hw.optional.neon") != 1:
            return frozenset()
        flags = {key: read(key) for key in _ARM_KEYS}
        if flags["hw.optional.arm.FEAT_DotProd"] is None:  # macOS 11
            flags["hw.optional.arm.FEAT_DotProd"] = 1
        return frozenset({"asimd", "fp", *(_ARM_KEYS[k] for k, on in flags.items() if on == 1)})
    words: list[str] = []
    for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features",
                "machdep.cpu.extfeatures"):
        value = read(key)
        if isinstance(value, str):
            words += value.split()
    return frozenset(_X86_NAMES.get(w, w.lower()) for w in words)


def compute_cores(read: Read = sysctl) -> int | None:
    """The cores worth one compute thread each: Apple Silicon's performance cores
    (hw.perflevel0.physicalcpu where there are two kinds), else the physical cores
    (hw.physicalcpu: an Intel Mac's hyperthreads share a core's vector units); None off macOS.
    Threads that wait for each other at every op run at the pace of the slowest: on the
    efficiency cores beside them, 2-4x slower, so llama.cpp counts these alone too."""
    levels = read("hw.nperflevels")
    two_kinds = isinstance(levels, int) and levels > 1
    cores = read("hw.perflevel0.physicalcpu") if two_kinds else read("hw.physicalcpu")
    return cores if isinstance(cores, int) and cores > 0 else None
