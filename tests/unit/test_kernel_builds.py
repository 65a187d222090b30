"""Every kernel variant builds (gcc, clang, the AArch64 cross gcc), and the kernels' tests pass on
every variant this CPU runs. Compiling is slow: every test here is."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loom.kernels import build, dispatch
from loom.kernels.dispatch import runs_here
from loom.sampling_params import SamplingParams
from tests import background
from tests.engine_fixtures import make_llm  # noqa: F401 - the fixture
from tests.model.test_team_size_bits import PROMPTS

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


# The cross-checking builds run as background jobs (tests/background.py: in the idle
# scheduling class from the start of the run, on the core the rest leaves idle). They check
# that each compiler's front end and code generation take every variant's sources (errors
# there do not depend on -O; -O0 still inlines always_inline and checks each intrinsic's
# target features), so not at the install's -O3, which the suite builds and tests on every
# variant this CPU runs (`make install`, the kernel tests per variant below). On the 2-core
# Zen 3: gcc at -O1 the variants this CPU cannot run, 121 s of CPU for the four AVX-512 ones (at
# -O3 332 s for those and generic); clang at -O0 every variant (37 s against 64 at -O1). Each
# into a folder of its own.
def _common(opt: str) -> tuple[str, ...]:
    return tuple(opt if f == "-O3" else f for f in build.COMMON)


CLANG_COMMON, GCC_COMMON = _common("-O0"), _common("-O1")
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


# the variants this CPU cannot run; those it runs are built at -O3 by `make install` (its best)
# and by the kernel tests on each other one (their first use)
GCC_BUILD = ("import sys; from pathlib import Path; from loom.kernels import build, dispatch; "
             f"build.COMMON = {GCC_COMMON!r}; "
             "got = build.build_many([v for v in dispatch.variants() if not dispatch.runs_here(v)],"
             " 'gcc', Path('{out}')); print(got); "
             "sys.exit(any(isinstance(e, build.BuildError) for e in got.values()))")


@pytest.mark.background("gcc-build", [sys.executable, "-c", GCC_BUILD])
def test_every_x86_variant_builds_with_gcc(monkeypatch) -> None:
    """Each variant builds, and holds the kernels its flags allow (checked where this CPU can
    load it)."""
    cc = build.compiler()
    if cc is None or shutil.which("gcc") is None or dispatch.machine() != "x86_64":
        pytest.skip("needs gcc on x86-64")
    job = background.result("gcc-build")
    assert job.returncode == 0, job.stderr[-3000:] + job.stdout[-3000:]
    ours = build.build_many([v for v in dispatch.variants() if runs_here(v)], cc)
    _built(ours)
    with monkeypatch.context() as m:
        m.setattr(build, "COMMON", GCC_COMMON)
        others = build.build_many([v for v in dispatch.variants() if not runs_here(v)], "gcc",
                                  job.out)  # what the job built, or its errors
    _built(others)
    assert len(ours) + len(others) == len(dispatch.variants())
    want = {"generic": (0, 0), "avx2": (1, 0), "avx512": (0, 0), "vnni": (1, 0), "bf16": (1, 1),
            "amx": (1, 1)}
    for name, so in ours.items():
        assert _flags(so)[:2] == want[name], name


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
        _c_checks_pass(AARCH64_CC, so, tmp_path / name, [qemu, "-L", "/usr/aarch64-linux-gnu"])


def _c_checks_pass(cc: str, so: Path, folder: Path, runner: list[str] = (),
                   checks: tuple[str, ...] = ("kernel_check.c", "kquant_check.c")) -> None:
    """tests/unit's C programs against the kernels in `so`: built by `cc`, run (by `runner`,
    qemu-user for another architecture), each says ok."""
    folder.mkdir(parents=True, exist_ok=True)
    for check in checks:
        exe = folder / check.removesuffix(".c")
        subprocess.run([cc, "-O1", str(ROOT / "tests/unit" / check), str(so), "-o", str(exe),
                        "-lm", f"-Wl,-rpath,{so.parent}"], check=True)
        run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "ok" in run.stdout, (so, check, run.stdout, run.stderr)


# A C compiler with no OpenMP of its own, as Apple's clang is: it refuses -fopenmp, except
# (apple=1) passed to its preprocessor alone, the form that links a separate libomp.
NO_OPENMP_CC = """#!/bin/sh
apple=@APPLE@ prev=
for a in "$@"; do
  if [ "$a" = -fopenmp ] && { [ -z "$apple" ] || [ "$prev" != -Xpreprocessor ]; }; then
    echo "clang: error: unsupported option '-fopenmp'" >&2; exit 1
  fi
  prev=$a
done
exec @CC@ "$@"
"""


def _no_openmp_cc(path: Path, real: str, apple: bool) -> str:
    path.write_text(NO_OPENMP_CC.replace("@CC@", real).replace("@APPLE@", "1" if apple else ""))
    path.chmod(0o755)
    return str(path)


def test_apples_clang_form_binds_to_the_openmp_runtime_torch_loaded(tmp_path,
                                                                    monkeypatch) -> None:
    """Where the compiler refuses -fopenmp (Apple's clang) and torch ships libomp (its macOS
    wheels; here LLVM's libomp, Debian's libomp-dev, stands in for it), openmp() takes
    -Xpreprocessor -fopenmp with the runtime left unlinked: a parallel region built so runs on
    two threads of the runtime the process has loaded (torch's, there), naming none itself.
    On macOS that form comes before -fopenmp."""
    libs = sorted(Path("/usr/lib").glob("llvm-*/lib/libomp.so"))
    if shutil.which("clang") is None or not libs:
        pytest.skip("no clang with LLVM's libomp (make install-test installs libomp-dev)")
    assert build.openmp(build.compiler() or "cc").cflags == ("-fopenmp",)  # gcc: its own
    assert build.torch_libomp() is None  # torch's Linux wheel ships libgomp
    monkeypatch.setattr(build, "torch_libomp", lambda: libs[-1])
    mac = build.openmp_candidates("darwin")
    assert [c.cflags for c in mac] == [("-Xpreprocessor", "-fopenmp"), ("-fopenmp",)]
    assert mac[0].ldflags == ("-Wl,-undefined,dynamic_lookup",)
    cc = _no_openmp_cc(tmp_path / "apple-clang", "clang", apple=True)
    omp = build.openmp(cc)
    assert omp.cflags == ("-Xpreprocessor", "-fopenmp") and omp.ldflags == () and omp.threads
    (tmp_path / "probe.c").write_text(build.PROBE)
    so = tmp_path / "probe.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-I{build.CSRC}", *omp.cflags,
                    str(tmp_path / "probe.c"), "-o", str(so), *omp.ldflags], check=True)
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
    assert "omp" not in needed, needed
    run = subprocess.run([sys.executable, "-c", "import ctypes, sys; from pathlib import Path; "
                          "from loom.kernels import build; "
                          "build.torch_libomp = lambda: Path(sys.argv[2]); "
                          "build.share_torch_libomp(); "  # as Loom does before loading kernels
                          "print(ctypes.CDLL(sys.argv[1]).loom_omp_probe())", str(so),
                          str(libs[-1])], env={**os.environ, "OMP_NUM_THREADS": "2"},
                         capture_output=True, text=True, cwd=ROOT)
    assert run.stdout.split() == ["2"], run.stderr
    none = _no_openmp_cc(tmp_path / "no-openmp", "clang", apple=False)
    assert build.openmp(none) == build.SERIAL and not build.SERIAL.threads  # one thread


@pytest.mark.parametrize("name", ["neon", "avx2"])
def test_the_sources_compile_for_macos(name) -> None:
    """Every source with clang as a Mac builds it: no __linux__ (decoder_q8.c's barrier sleeps
    in sched_yield, linear_amx.c asks no kernel for tiles), __APPLE__, the OpenMP form Apple's
    clang takes, the variant's flags (Apple Silicon's and Intel Macs' builds). Syntax and
    intrinsics only, against Debian's C headers: no macOS SDK here to link one."""
    v = dispatch.variant(name, "aarch64" if name == "neon" else "x86_64")
    target = f"{v.arch}-linux-gnu"  # Debian's headers (the AArch64 ones the cross gcc's)
    headers = ["-isystem", "/usr/aarch64-linux-gnu/include"] if v.arch == "aarch64" else []
    if shutil.which("clang") is None or (headers and not Path(headers[1]).is_dir()):
        pytest.skip("no clang or no AArch64 C headers (make install-test installs them as root)")
    for source in build.SOURCES:
        run = subprocess.run(["clang", "-target", target, *headers, "-U__linux__", "-U__linux",
                              "-Ulinux", "-U__gnu_linux__", "-D__APPLE__", "-Xpreprocessor",
                              "-fopenmp", *build.COMMON, *v.cflags, *build.file_flags(source),
                              "-fsyntax-only", str(build.CSRC / source)],
                             capture_output=True, text=True)
        assert run.returncode == 0 and "warning" not in run.stderr, (source, run.stderr[-2000:])


SERIAL_BUILD = (
    "from pathlib import Path; from loom.kernels import build, dispatch; "
    "from tests.unit.test_kernel_builds import _no_openmp_cc; "
    "out = Path('{out}'); cc = _no_openmp_cc(out / 'cc', 'cc', apple=False); "
    "build.build(dispatch.variant(dispatch.choose().variant), cc, out / 'kernels')")
GENERATE = (  # greedy_bits of the default model, and the library that ran
    "import json; from loom import LLM; from loom.kernels import cpu_kernels; "
    "from tests.unit.test_kernel_builds import greedy_bits; "
    "out = greedy_bits(LLM(None, dtype='float32', batch_invariant=False)); "
    "print(json.dumps({'so': cpu_kernels()._name, 'out': out}))")


def greedy_bits(llm) -> list:  # noqa: ANN001 - an LLM
    """test_team_size_bits' prompts, greedy, 16 tokens each: their ids and top-3 logprobs, as
    JSON gives them back."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    return [[o.outputs[0].token_ids, [[q.token_ids, q.logprobs] for q in o.outputs[0].logprobs]]
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.background("serial-build", [sys.executable, "-c", SERIAL_BUILD])
def test_a_compiler_without_openmp_builds_one_thread_kernels(make_llm) -> None:  # noqa: F811
    """A compiler that refuses -fopenmp (Apple's clang without libomp) still builds this CPU's
    kernels, without OpenMP (no runtime linked): the kernels' C checks pass on them, and the
    default model's greedy tokens and logprobs are the bits the OpenMP build gives."""
    cc = build.compiler()
    if cc is None or dispatch.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    job = background.result("serial-build")
    assert job.returncode == 0, job.stderr[-3000:]
    serial = str(job.out / "cc")
    assert build.openmp(serial) == build.SERIAL
    v = dispatch.variant(dispatch.choose().variant)
    so = build.build(v, serial, job.out / "kernels")  # the job's
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
    assert "NEEDED" in needed and "omp" not in needed, needed
    # the int8 grid's kernels (kquant_check.c's bounds are the AArch64 builds' fp32 kernel's
    # past 8 rows, not x86's int16 one: the K-quants run in tests/model/test_kquant.py)
    _c_checks_pass(cc, so, job.out / "checks", checks=("kernel_check.c",))
    env = {**os.environ, "CC": serial, "LOOM_CACHE_DIR": str(job.out)}
    run = subprocess.run([sys.executable, "-c", GENERATE], env=env, capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "one thread" in run.stderr, run.stderr[-3000:]  # said, loudly
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["so"] == str(so)
    assert got["out"] == greedy_bits(make_llm(batch_invariant=False))


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
