"""Tests of the C kernels need them built: where a C compiler exists, a failed build fails.

Each helper also selects the build its test runs (loom.kernels.select; process-wide), so a test
never inherits another's choice: `require_cpu_kernels` the best this CPU runs, the others the
variant whose kernel they name, skipping where the CPU lacks it."""

from __future__ import annotations

import os
import shutil

import pytest

from loom.kernels import ENV_SWITCH, cpu_kernels, select
from loom.kernels.dispatch import runs_here, variant


def require_cpu_kernels() -> None:
    if os.environ.get(ENV_SWITCH) == "0":
        pytest.skip(f"{ENV_SWITCH}=0")
    if not shutil.which(os.environ.get("CC") or "cc"):
        pytest.skip("no C compiler")
    select()
    assert cpu_kernels() is not None, "a C compiler is present but the CPU kernels did not build"


def _require(name: str, cpu: str) -> None:
    require_cpu_kernels()
    if os.environ.get(ENV_SWITCH, "auto") != "auto":
        pytest.skip(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]} fixes the build")
    if not runs_here(variant(name)):
        pytest.skip(f"no {cpu} on this CPU")
    select(name)


def require_amx() -> None:
    """The AMX kernel needs a CPU with AMX-BF16 (Sapphire Rapids on); elsewhere its tests skip."""
    _require("amx", "AMX-BF16")
    if not cpu_kernels().loom_amx_available():
        pytest.skip("Linux does not grant this process the AMX tiles")


def require_bf16() -> None:
    """The bf16 kernel needs a CPU with AVX512-BF16 (Zen 4, Cooper Lake on); elsewhere its tests
    skip."""
    _require("bf16", "AVX512-BF16")


def require_int16() -> None:
    """The int8 grid's int16 kernel past 8 rows (linear_kq_gemm.c) is the AVX2 build's; on
    CPUs without AVX2 its tests skip."""
    _require("avx2", "AVX2")
    assert cpu_kernels().loom_i16_available(), "the avx2 build has no int16 kernel"


def require_vnni() -> None:
    """The VNNI decode kernel needs a CPU with AVX512-VNNI (Ice Lake, Zen 4 on); elsewhere its
    tests skip."""
    _require("vnni", "AVX512-VNNI")


def require_int_decode(build: str) -> None:
    """The integer decode kernel (linear_vnni.c) of `build`: "vnni" (AVX512-VNNI) or "avx2"
    (its AVX2 form, vpmaddwd), skipping where the CPU lacks it."""
    if build == "vnni":
        require_vnni()
    else:
        _require(build, build.upper())
        assert cpu_kernels().loom_vnni_available(), f"the {build} build has no integer kernel"
