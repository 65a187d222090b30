"""Tests of the C kernels need them built: where a C compiler exists, a failed build fails."""

from __future__ import annotations

import os
import shutil

import pytest

from loom.kernels import ENV_SWITCH, cpu_kernels


def require_cpu_kernels() -> None:
    if os.environ.get(ENV_SWITCH) == "0":
        pytest.skip(f"{ENV_SWITCH}=0")
    if not shutil.which(os.environ.get("CC") or "cc"):
        pytest.skip("no C compiler")
    assert cpu_kernels() is not None, "a C compiler is present but the CPU kernels did not build"


def require_amx() -> None:
    """The AMX kernel needs a CPU with AMX-BF16 (Sapphire Rapids on); elsewhere its tests skip."""
    require_cpu_kernels()
    if not cpu_kernels().loom_amx_available():
        pytest.skip("no AMX-BF16 on this CPU")


def require_bf16() -> None:
    """The bf16 kernel needs a CPU with AVX512-BF16 (Zen 4, Cooper Lake on); elsewhere its tests
    skip."""
    require_cpu_kernels()
    if not cpu_kernels().loom_bf16_available():
        pytest.skip("no AVX512-BF16 on this CPU")


def require_vnni() -> None:
    """The VNNI decode kernel needs a CPU with AVX512-VNNI (Ice Lake, Zen 4 on); elsewhere its
    tests skip."""
    require_cpu_kernels()
    if not cpu_kernels().loom_vnni_available():
        pytest.skip("no AVX512-VNNI on this CPU")
