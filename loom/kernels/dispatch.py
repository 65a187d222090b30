"""Which CPU kernels Loom runs: the one module that knows instruction sets.

Loom's C kernels (csrc/) are compiled once per instruction-set level (`VARIANTS`, best first;
loom.kernels.build compiles them at install). At start-up this module reads the CPU's features
once (/proc/cpuinfo's `flags` on x86, its `Features` on AArch64; sysctl on macOS), takes the best variant the CPU
runs and that built, and in it chooses each kernel: the int8 linears' kernel for steps of more
than 8 rows (`batch`) and of up to 8 (`decode`), and the KV cache's dtype where `auto`. Every
default kernel meets Loom's accuracy bar: teacher-forced top-1 agreement with the fp32 reference
of at least 99% on the default model (tests/model/test_dispatch_fidelity.py). The decoder, the
linears, attention and the loader ask this module; `--cpu-kernels NAME` (or LOOM_CPU_KERNELS)
picks a variant by name, `--batch-invariant` the kernels whose bits do not depend on the batch.

Kernels by name (loom.quant.int8): batch "fp32" (linear_q8.c: fp32 products, a request's bits
the same in any batch), "bf16" (AVX512-BF16 dot products, bf16 precision), "amx" (AMX tiles,
fp32 precision; the bits depend on whether a step has more than 8 rows), "vnni" (the AArch64
builds: the decode kernel below in chunks of 8 rows, the same bits at any batch), "int16" (AVX2
vpmaddwd, linear_kq_gemm.c: each super-block of 256 weights rounded to 13-bit integers, x to 15
bits a super-block; the same dependence); decode "fp32" or
"vnni" (integer dot products, x in two int8 digits a group: AVX512-VNNI's vpdpwssd, in the
AVX2 build vpmaddwd, in the AArch64 builds sdot or widening multiplies, the same integers).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass, replace

from loom.darwin import cpu_features as sysctl_features

logger = logging.getLogger(__name__)

ENV = "LOOM_CPU_KERNELS"  # a variant's name, "auto" (default) or "0" (no C kernels at all)


@dataclass(frozen=True)
class Variant:
    """One build of the C kernels: the compiler flags that set its instruction set, the CPU
    features it needs, and the int8 linears' kernels it runs by default."""

    name: str
    arch: str  # platform.machine() it is built for
    cflags: tuple[str, ...]
    needs: frozenset[str]  # /proc/cpuinfo flags (x86) or Features (AArch64)
    batch: str = "fp32"
    decode: str = "fp32"
    about: str = ""
    # K-quant linears (csrc/linear_kquant.c, loom.quant.kquant) up to 8 rows: integer dot
    # products in AVX512-VNNI ("vnni"), AVX-512 BW ("avx512"), AVX2 ("avx2"), NEON ("neon":
    # sdot, or its widening-multiply form without dot products) or portable C ("generic");
    # past 8 rows (csrc/linear_kq_gemm.c): panels of weight rows unpacked once a call against
    # all rows, in AVX512-BF16 dot products ("bf16"), int16 ones with x in one int16 a
    # super-block ("int16": 512-bit vpdpwssd in the vnni build, AVX2 vpmaddwd in the avx512 and
    # avx2 ones) or portable fp32 ("fp32"); "int": the integer kernel above at every size.
    kquant: str = "generic"
    kquant_batch: str = "fp32"


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})  # x86-64-v3
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
_X86 = ("x86_64", "AMD64")
_ARM = ("aarch64", "arm64")

# Best first on each architecture; "generic" (no -march) runs on any CPU of its architecture.
VARIANTS: tuple[Variant, ...] = (
    Variant("amx", "x86_64", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mf16c",
                              "-mamx-tile", "-mamx-bf16", "-mtune=sapphirerapids"),
            _V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx", "vnni",
            "AMX tiles past 8 rows, AVX512-VNNI up to 8", kquant="vnni", kquant_batch="bf16"),
    Variant("bf16", "x86_64", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
            _V4 | {"avx512_vnni", "avx512_bf16"}, "bf16", "vnni",
            "AVX512-BF16 past 8 rows, AVX512-VNNI up to 8", kquant="vnni", kquant_batch="bf16"),
    # int16 past 8 rows rather than AVX-512 fp32 FMAs: 0.53-0.84x the time on the vnni build's
    # 512-bit tile, 0.64-0.87x on the avx512 build's AVX2 one (benchmarks/bench_q8_i16.py,
    # 128 rows, a Zen 4 running each build, 2026-12-04)
    Variant("vnni", "x86_64", ("-march=x86-64-v4", "-mavx512vnni"),
            _V4 | {"avx512_vnni"}, "int16", "vnni",
            "AVX512-VNNI int16 dot products past 8 rows, AVX512-VNNI up to 8", kquant="vnni",
            kquant_batch="int16"),
    Variant("avx512", "x86_64", ("-march=x86-64-v4",), _V4, "int16",
            about="AVX2 int16 dot products past 8 rows, AVX-512 fp32 up to 8", kquant="avx512",
            kquant_batch="int16"),
    Variant("avx2", "x86_64", ("-march=x86-64-v3",), _V3, "int16", "vnni",
            "AVX2 int16 dot products past 8 rows and up to 8", kquant="avx2",
            kquant_batch="int16"),
    Variant("generic", "x86_64", ("-march=x86-64", "-mtune=generic"), frozenset(),
            about="portable x86-64 (SSE2)"),
    # AArch64: the int8 grid's integer kernel at every size (chunks of 8 rows past 8: the same
    # bits in any batch), the K-quants' too; neither timed on an ARM machine (instructions
    # counted under qemu-user: docs/cpu_kernels.md)
    Variant("neon", "aarch64", ("-march=armv8.2-a+dotprod",), frozenset({"asimd", "asimddp"}),
            "vnni", "vnni", "AArch64 NEON sdot dot products", kquant="neon", kquant_batch="int"),
    Variant("generic", "aarch64", ("-march=armv8-a",), frozenset(), "vnni", "vnni",
            "AArch64 NEON without dot products (widening multiplies)", kquant="neon",
            kquant_batch="int"),
)
NAMES = ("auto", *dict.fromkeys(v.name for v in VARIANTS))  # the --cpu-kernels choices


class KernelChoiceError(ValueError):
    """A --cpu-kernels choice this CPU (or this build) cannot run."""


def machine() -> str:
    m = platform.machine()
    return "x86_64" if m in _X86 else "aarch64" if m in _ARM else m


def variants(arch: str | None = None) -> list[Variant]:
    """The variants built for `arch` (default: this machine's), best first."""
    arch = arch or machine()
    return [v for v in VARIANTS if v.arch == arch]


def variant(name: str, arch: str | None = None) -> Variant:
    for v in variants(arch):
        if v.name == name:
            return v
    raise KernelChoiceError(f"unknown CPU kernels {name!r} for {arch or machine()}; choose from "
                            f"{', '.join(['auto', *(v.name for v in variants(arch))])}")


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags, read once: on AArch64 Linux the kernel's hwcaps
    (auxv_features); else /proc/cpuinfo's first `flags` (x86) or `Features` (AArch64) line;
    on macOS sysctl's, in the same names (loom.darwin). Empty where there is none: only the
    generic variant then runs."""
    if sys.platform == "darwin":
        return sysctl_features(machine())
    if machine() == "aarch64" and sys.platform.startswith("linux"):
        got = auxv_features()
        if got:
            return got
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


# AArch64 Linux's hwcap bits (asm/hwcap.h: AT_HWCAP's, AT_HWCAP2's) -> /proc/cpuinfo's names
_HWCAP = {0: "fp", 1: "asimd", 9: "fphp", 10: "asimdhp", 20: "asimddp", 22: "sve"}
_HWCAP2 = {1: "sve2", 13: "i8mm", 14: "bf16"}
AT_HWCAP, AT_HWCAP2 = 16, 26


def hwcap_features(hwcap: int, hwcap2: int) -> frozenset[str]:
    """The feature names of AArch64 hwcap words."""
    return frozenset([n for bit, n in _HWCAP.items() if hwcap >> bit & 1]
                     + [n for bit, n in _HWCAP2.items() if hwcap2 >> bit & 1])


def auxv_features(getauxval=None) -> frozenset[str]:  # noqa: ANN001
    """What the kernel says this process's CPU runs (getauxval's hwcaps: llama.cpp's and
    torch's probe), where /proc/cpuinfo may describe another one: under qemu-user (an arm64
    container on an x86 host) it is the host's, whose x86 flags gave the generic build.
    Empty where libc has no getauxval. `getauxval`: the function to ask (default: libc's)."""
    if getauxval is None:
        import ctypes

        getauxval = getattr(ctypes.CDLL(None), "getauxval", None)
        if getauxval is None:
            return frozenset()
        getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return hwcap_features(getauxval(AT_HWCAP), getauxval(AT_HWCAP2))


def runs_here(v: Variant) -> bool:
    """Whether this CPU runs variant `v`'s code."""
    return v.arch == machine() and v.needs <= cpu_features()


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a process runs: the build (`variant`) and, for the int8 linears, the kernel
    past 8 rows (`batch`) and up to 8 (`decode`); `kv_cache_dtype`: what "auto" means for the
    KV cache of a model on these kernels; `named`: the build was asked for by name, not "auto"."""

    variant: str
    batch: str
    decode: str
    kv_cache_dtype: str
    batch_invariant: bool
    named: bool = False

    @property
    def five_bit(self) -> bool:
        """Whether Q5_0 / Q5_1 weights keep 5 bits a weight on the int8 grid (its 5-bit form) or
        take a byte: 5 where decode runs the AVX-512 VNNI kernel, whose mask registers add the
        fifth bits in one instruction a vector of 32 (Zen 4, bf16 build, in process: Gemma 3
        270M's decode 0.94x the time, the 1.7B shape in Q5_0 0.65x, 0.75x the memory); a byte
        elsewhere, where the 5-bit form measured slower on the same Zen 4: the avx2 build's
        VNNI form (no mask registers: four instructions a vector of 16) 1.07x and 1.14-1.23x
        the time, the avx512 build's fp32 decode (and --batch-invariant's) 1.04-1.05x and
        1.23x; NEON and the portable builds only have scalar code for the bits.
        docs/cpu_dispatch.md."""
        return self.decode == "vnni" and "avx512bw" in variant(self.variant).needs

    def summary(self) -> str:
        """The build, why, and the int8 linears' kernels, in one phrase (the start-up line's)."""
        why = ("chosen with --cpu-kernels" if self.named else "the best of " + ", ".join(
            v.name for v in variants() if runs_here(v)) + " this CPU runs")
        r16 = self.interleaved_q4k and self.kquant_batch != "int"
        return (f"{self.variant} build ({variant(self.variant).about}; {why}); int8 linears "
                f"{self.batch} past 8 rows, {self.decode} up to 8"
                f"{' (batch-invariant)' if self.batch_invariant else ''}; K-quant linears "
                f"{self.kquant} up to 8 rows, "
                f"{self.kquant if self.kquant_batch == 'int' else self.kquant_batch} past 8"
                f"{' (Q4_K interleaved: up to 32)' if r16 else ''}")

    @property
    def interleaved_q4k(self) -> bool:
        """Whether the loader interleaves Q4_K rows (builds with AVX512-VNNI: loom.h's
        LOOM_KQ_R16), whose integer kernel then runs up to 32 rows before the batch kernel."""
        return "avx512_vnni" in variant(self.variant).needs

    @property
    def kquant(self) -> str:
        """The K-quant linears' kernel up to 8 rows (Variant.kquant), and past 8 where
        kquant_batch is "int": the same bits at any batch in a build."""
        return variant(self.variant).kquant

    @property
    def kquant_batch(self) -> str:
        """The K-quant linears' kernel past 8 rows (Variant.kquant_batch): "bf16", "int16",
        "fp32" or "int" (the kernel of up to 8 rows; batch-invariant)."""
        return "int" if self.batch_invariant else variant(self.variant).kquant_batch

    @property
    def same_bits_past_8(self) -> bool:
        """Whether a row's bits stay what they are at up to 8 rows when its step has more (the
        int8 and K-quant linears keep their kernels' bits past 8 rows)."""
        return self.batch_invariant or (self.batch == self.decode in ("fp32", "vnni")
                                        and self.kquant_batch == "int")

    def describe(self) -> str:
        return (f"CPU kernels: {self.summary()}; quantized models' KV cache "
                f"{self.kv_cache_dtype}. Override: --cpu-kernels, --batch-invariant")


def requested() -> str:
    """LOOM_CPU_KERNELS: "auto" unless set."""
    return os.environ.get(ENV, "auto") or "auto"


def choose(name: str = "auto", batch_invariant: bool = False,
           failed: frozenset[str] = frozenset()) -> KernelChoice:
    """The kernels for --cpu-kernels `name`: "auto" takes the best variant this CPU runs and
    whose build did not fail (`failed`), a name that variant (KernelChoiceError where the CPU
    lacks what it needs or its build failed). `batch_invariant`: int8 linears whose bits do not
    depend on the batch (the fp32 kernels; the AArch64 builds' own)."""
    usable = [v for v in variants() if runs_here(v) and v.name not in failed]
    if name == "auto":
        if not usable:
            raise KernelChoiceError("no CPU kernel build runs on this CPU")
        v = usable[0]
    else:
        v = variant(name)
        missing = v.needs - cpu_features()
        if missing:
            raise KernelChoiceError(f"CPU kernels {name!r} need {', '.join(sorted(missing))}, "
                                    "which this CPU lacks")
        if v not in usable:
            raise KernelChoiceError(f"CPU kernels {name!r} failed to build (see the log)")
    own = KernelChoice(v.name, v.batch, v.decode, "int8", False, name != "auto")
    # batch_invariant: the fp32 kernels, unless the build's own already keep a row's bits past
    # 8 rows (the AArch64 builds: one integer kernel at every size)
    if batch_invariant and not own.same_bits_past_8:
        own = replace(own, batch="fp32", decode="fp32")
    return replace(own, batch_invariant=batch_invariant)


def granted(choice: KernelChoice, amx_tiles: bool) -> KernelChoice:
    """`choice` once its build is loaded: where Linux withholds the AMX tiles from this process
    (`amx_tiles` False: the library's loom_amx_available), the amx build's AVX512-BF16 dot
    products past 8 rows instead."""
    if choice.batch == "amx" and not amx_tiles:
        return replace(choice, batch="bf16")
    return choice
