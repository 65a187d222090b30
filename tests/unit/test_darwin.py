"""macOS's answers (loom.darwin) in the names the kernel dispatch asks for: which build an Apple
Silicon or Intel Mac runs, its performance cores. The sysctl values are as those machines give
them (`sysctl hw.optional machdep.cpu hw.nperflevels ...`); on Linux the real sysctl has none,
and psutil answers for the memory free (the KV cache's default size) on both."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from loom import darwin
from loom.heap import meminfo
from loom.kernels import dispatch
from loom.worker.kv_cache import available_memory

M1 = {"hw.optional.arm64": 1, "hw.optional.neon": 1, "hw.optional.arm.FEAT_DotProd": 1,
      "hw.optional.arm.FEAT_FP16": 1, "hw.optional.arm.FEAT_I8MM": 0,
      "hw.optional.arm.FEAT_BF16": 0, "hw.nperflevels": 2, "hw.perflevel0.physicalcpu": 4,
      "hw.perflevel1.physicalcpu": 4}
M1_MACOS_11 = {"hw.optional.arm64": 1, "hw.optional.neon": 1}  # before the FEAT_ keys
INTEL_MAC = {  # a Core i7-8850H (Coffee Lake), macOS 12
    "machdep.cpu.features": "FPU VME DE PSE TSC MSR PAE MCE CX8 APIC SEP MTRR PGE MCA CMOV PAT "
    "PSE36 CLFSH DS ACPI MMX FXSR SSE SSE2 SS HTT TM PBE SSE3 PCLMULQDQ DTES64 MON DSCPL VMX SMX "
    "EST TM2 SSSE3 FMA CX16 TPR PDCM SSE4.1 SSE4.2 x2APIC MOVBE POPCNT AES PCID XSAVE OSXSAVE "
    "SEGLIM64 TSCTMR AVX1.0 RDRAND F16C",
    "machdep.cpu.leaf7_features": "RDWRFSGS TSC_THREAD_OFFSET SGX BMI1 HLE AVX2 SMEP BMI2 ERMS "
    "INVPCID RTM FPU_CSDS MPX RDSEED ADX SMAP CLFSOPT IPT SGXLC MDCLEAR TSXFA IBRS STIBP L1DF "
    "SSBD",
    "machdep.cpu.extfeatures": "SYSCALL XD 1GBPAGE EM64T LAHF LZCNT PREFETCHW RDTSCP TSCI",
    "hw.nperflevels": 1, "hw.perflevel0.physicalcpu": 6}
MAC_PRO_2019 = {  # a Xeon W-3245 (Cascade Lake): AVX-512 with VNNI
    **INTEL_MAC, "machdep.cpu.leaf7_features": "RDWRFSGS TSC_THREAD_OFFSET BMI1 AVX2 SMEP BMI2 "
    "ERMS INVPCID FPU_CSDS AVX512F AVX512DQ RDSEED ADX SMAP CLFSOPT CLWB IPT AVX512CD AVX512BW "
    "AVX512VL AVX512VNNI MDCLEAR IBRS STIBP L1DF ACAPMSR SSBD"}


def _best(arch: str, sysctl: dict) -> str:
    """The build dispatch.choose takes on such a Mac: the first of the architecture's variants
    whose needs its features cover."""
    feats = darwin.cpu_features(arch, sysctl.get)
    return next(v.name for v in dispatch.variants(arch) if v.needs <= feats)


@pytest.mark.parametrize(("arch", "sysctl", "build"), [
    ("aarch64", M1, "neon"), ("aarch64", M1_MACOS_11, "neon"), ("aarch64", {}, "generic"),
    ("x86_64", INTEL_MAC, "avx2"), ("x86_64", MAC_PRO_2019, "vnni"), ("x86_64", {}, "generic")])
def test_a_mac_runs_the_build_its_cpu_has(arch, sysctl, build) -> None:
    assert _best(arch, sysctl) == build


def test_mac_feature_names_are_proc_cpuinfos() -> None:
    intel = darwin.cpu_features("x86_64", INTEL_MAC.get)
    assert {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse4_2"} <= intel
    assert not {n for n in intel if n.startswith("avx512")}
    assert "avx512_vnni" in darwin.cpu_features("x86_64", MAC_PRO_2019.get)
    m1 = darwin.cpu_features("aarch64", M1.get)
    assert {"asimd", "asimddp", "asimdhp"} <= m1 and not {"i8mm", "bf16"} & m1


def test_compute_cores_are_the_performance_cores_or_the_physical_ones() -> None:
    assert darwin.compute_cores(M1.get) == 4  # not its 4 efficiency cores
    assert darwin.compute_cores({**INTEL_MAC, "hw.physicalcpu": 6, "hw.logicalcpu": 12}.get) == 6
    assert darwin.compute_cores({}.get) is None


@pytest.mark.skipif(sys.platform == "darwin", reason="Linux's answers")
def test_off_macos_sysctl_says_nothing_and_psutil_gives_the_memory() -> None:
    assert darwin.sysctl("hw.memsize") is None
    assert darwin.compute_cores() is None
    free, info = available_memory(torch.device("cpu")), meminfo()  # the KV cache's default
    assert free is not None and 0 < free <= info["MemTotal"]


def test_sysctl_reads_values_through_the_c_signature() -> None:
    """sysctl() as it calls libc's sysctlbyname on macOS (the size, then the value, through
    the C signature), against a C callback that answers as macOS's does: numbers as 4 or 8
    little-endian bytes, texts NUL-terminated, -1 for an unknown key."""
    values = {b"hw.optional.arm.FEAT_DotProd": (1).to_bytes(4, "little"),
              b"hw.memsize": (16 << 30).to_bytes(8, "little"),
              b"machdep.cpu.features": b"FPU SSE4.2 AVX1.0 FMA\0"}
    calls = []

    def answer(name, oldp, oldlenp, newp, newlen):  # noqa: ANN001, ANN202 - C's arguments
        calls.append((name, oldp is None))
        value = values.get(name)
        if value is None:
            return -1
        if oldp is not None:
            ctypes.memmove(oldp, value, min(len(value), oldlenp[0]))
        oldlenp[0] = len(value)
        return 0

    fn = darwin.SYSCTLBYNAME(answer)
    assert darwin.sysctl("hw.optional.arm.FEAT_DotProd", fn) == 1
    assert darwin.sysctl("hw.memsize", fn) == 16 << 30
    assert darwin.sysctl("machdep.cpu.features", fn) == "FPU SSE4.2 AVX1.0 FMA"
    assert darwin.sysctl("hw.optional.arm.FEAT_SME", fn) is None
    assert calls[:2] == [(b"hw.optional.arm.FEAT_DotProd", True),
                         (b"hw.optional.arm.FEAT_DotProd", False)]  # the size, then the value
