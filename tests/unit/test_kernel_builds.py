"""Every kernel variant builds (gcc, clang, the AArch64 cross gcc), and the kernels' tests pass on
every variant this CPU runs. Compiling is slow: every test here is."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loom.kernels import build, dispatch
from loom.kernels.dispatch import runs_here
from tests import background

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The kernels' own tests (attention, the layer ops, the int8 linear and quantizer), run again
# on each variant this CPU runs but does not choose (the suite runs them on the one it does).
KERNEL_TESTS = ["tests/unit/test_cpu_layer_ops.py", "tests/unit/test_cpu_attention.py",
                "tests/model/test_quant.py", "tests/model/test_kquant.py",
                "tests/model/test_kq_gemm.py"] + [
    f"tests/model/test_hybrid.py::test_{mixer}_c_decode_step_equals_the_torch_path"
    for mixer in ("gdn", "mamba2", "shortconv")]
KERNEL_TEST_FILTER = ("not build_is_cached and not smollm2 and not reference and not stack "
                      "and not sampling_rows and not dispatch and not head_reuses "
                      "and not fp16 and not int4 and not gemma3")


# The two cross-checking builds run as background jobs (tests/background.py: in the idle
# scheduling class from the start of the run, on the core the rest leaves idle; ~40 and ~65 s
# of both cores on a 2-core Zen 3). clang at -O0: what its build checks is that clang's front end and code generation
# take every variant's sources (errors there do not depend on -O; -O0 still inlines
# always_inline and checks each intrinsic's target features), in 37 s against 64 at -O1.
CLANG_COMMON = tuple("-O0" if f == "-O3" else f for f in build.COMMON)
CLANG_BUILD = ("import sys; from loom.kernels import build; "
               f"build.COMMON = {CLANG_COMMON!r}; "
               "sys.exit(build.main(['--cc', 'clang', '--all', '--out', '{out}']))")
AARCH64_CC = "aarch64-linux-gnu-gcc"


def _built(results: dict[str, Path | build.BuildError]) -> None:
    failed = {name: str(e) for name, e in results.items() if isinstance(e, build.BuildError)}
    assert not failed, failed


def _flags(so: Path) -> tuple[int, int, int]:
    lib = ctypes.CDLL(str(so))
    return lib.loom_vnni_available(), lib.loom_bf16_available(), lib.loom_amx_available()


# `make install` builds the variants this CPU runs; the others (the AVX-512, VNNI, BF16 and AMX
# ones on an AVX2 machine: ~2 min of both cores at -O3) into the same folder in the background.
@pytest.mark.background("gcc-build", [sys.executable, "-m", "loom.kernels.build", "--all"])
def test_every_x86_variant_builds_with_gcc() -> None:
    """Into the kernels' folder, beside what `make install` built: each variant holds the
    kernels its flags allow (checked where this CPU can load it)."""
    cc = build.compiler()
    if cc is None or dispatch.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    job = background.result("gcc-build")
    assert job.returncode == 0, job.stderr[-3000:]
    results = build.build_all(cc)  # what the job built, or its errors
    _built(results)
    want = {"generic": (0, 0), "avx2": (1, 0), "avx512": (0, 0), "vnni": (1, 0), "bf16": (1, 1),
            "amx": (1, 1)}
    for v in dispatch.variants():
        if runs_here(v):
            assert _flags(results[v.name])[:2] == want[v.name], v.name


@pytest.mark.background("clang-build", [sys.executable, "-c", CLANG_BUILD])
def test_every_x86_variant_builds_with_clang(monkeypatch) -> None:
    if shutil.which("clang") is None or dispatch.machine() != "x86_64":
        pytest.skip("no clang on this x86-64 machine (make install-test installs it as root)")
    probe = subprocess.run(["clang", "-fopenmp", "-x", "c", "-c", "-", "-o", os.devnull],
                           input="#include <omp.h>\n", capture_output=True, text=True)
    if probe.returncode:
        pytest.skip("clang has no OpenMP headers (Debian: libomp-dev)")
    job = background.result("clang-build")
    assert job.returncode == 0, job.stderr[-3000:]
    monkeypatch.setattr(build, "COMMON", CLANG_COMMON)
    _built(build.build_all("clang", out_dir=job.out))  # what the job built, or its errors


@pytest.mark.background("aarch64-build", [sys.executable, "-m", "loom.kernels.build", "--cc",
                                          AARCH64_CC, "--arch", "aarch64", "--out", "{out}"])
def test_aarch64_variants_build_and_run_under_qemu(tmp_path) -> None:
    """The AArch64 variants with Debian's cross gcc; where qemu-user is there, small C programs
    linked to each run its int8 linear, quantizer and silu against plain loops, its integer
    int8 linear (NEON sdot, or widening multiplies in the generic build) against float64 sums
    of x as it quantizes it, and its K-quant linears (the same integer forms; the portable fp32
    kernel past 8 rows) against a float64 product."""
    if shutil.which(AARCH64_CC) is None:
        pytest.skip("no aarch64-linux-gnu-gcc (make install-test installs it as root)")
    job = background.result("aarch64-build")
    assert job.returncode == 0, job.stderr[-3000:]
    results = build.build_all(AARCH64_CC, "aarch64", job.out)  # what the job built, or its errors
    _built(results)
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("no qemu-aarch64: built, not run")
    for name, so in results.items():
        for check in ("kernel_check.c", "kquant_check.c"):
            exe = tmp_path / f"{check.removesuffix('.c')}-{name}"
            subprocess.run([AARCH64_CC, "-O1", str(ROOT / "tests/unit" / check), str(so), "-o",
                            str(exe), "-lm", f"-Wl,-rpath,{so.parent}"], check=True)
            run = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe)],
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0 and "ok" in run.stdout, (name, check, run.stdout,
                                                                 run.stderr)


KERNEL_TESTS_RUN = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                    "not gpu", "-k", KERNEL_TEST_FILTER, *KERNEL_TESTS]


def _variant(name: str):  # noqa: ANN202
    """The variant's parameter, with its kernel tests as a background job where this CPU runs
    it and does not choose it."""
    if not runs_here(dispatch.variant(name)) or dispatch.choose().variant == name:
        return name
    return pytest.param(name, marks=pytest.mark.background(
        f"kernel-tests-{name}", KERNEL_TESTS_RUN, {**os.environ, dispatch.ENV: name}))


@pytest.mark.parametrize("name", [_variant(v.name) for v in dispatch.VARIANTS
                                  if v.arch == "x86_64" and v.name != "amx"])
def test_kernel_tests_pass_on_each_variant_this_cpu_runs(name) -> None:
    """The kernels' tests in a process that runs only this variant (LOOM_CPU_KERNELS)."""
    v = dispatch.variant(name)
    if not runs_here(v):
        pytest.skip(f"this CPU does not run the {name} build")
    if dispatch.choose().variant == name:
        pytest.skip(f"{name} is this CPU's own build: the suite runs its tests")
    env = {**os.environ, dispatch.ENV: name}
    which = subprocess.run([sys.executable, "-c", "from loom.kernels import kernel_choice; "
                            "print(kernel_choice().variant)"], env=env, capture_output=True,
                           text=True)
    assert which.stdout.split() == [name], which.stderr[-2000:]
    run = background.result(f"kernel-tests-{name}")
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout
