"""Compile Loom's C kernels once per instruction-set variant (loom.kernels.dispatch.VARIANTS).

`python -m loom.kernels.build` (run by `make install`) builds the best variant this CPU runs,
and the next one down only where that fails (on a 2-core AVX2 machine avx2 alone: 41 s, where
building generic too took 54 s more; a build named with --cpu-kernels is compiled on first use;
`--all` builds every variant of the architecture, as the suite's build check does), each into
its own shared object in `$LOOM_CACHE_DIR/kernels` (default
`~/.cache/loom/kernels`), named after the architecture, the variant and a hash of the sources,
the flags and the compiler's version: a changed source rebuilds, a warm machine loads in
milliseconds. A variant the compiler cannot build is disabled alone: its error is printed (and
logged where a process wanted it) and kept beside the others as `<name>.failed`, so no start
tries again; the next variant down runs. Where nothing was built at install, the variant a
process needs is compiled on first use.

Flags are per file, so gcc and clang build the same arithmetic (clang ignores gcc's
`optimize` pragmas and attributes): the attention and the elementwise ops with -ffast-math
(their dot products, reductions and expf vectorize; they never see an infinity or a NaN), the
linears, the quantizer and argmax in IEEE order (a request's bits then do not depend on its
batch, the quantizer matches torch's, argmax sees NaN), the decoder stack also without fused
multiply-adds (its embedding look-up rounds as torch's mul then add).

OpenMP (`openmp`, probed where a variant has no build yet): `-fopenmp` (gcc; clang with its
runtime); as Apple's clang needs, `-Xpreprocessor -fopenmp` with the OpenMP symbols bound to
the runtime torch ships and has loaded (torch/lib/libomp.dylib: one OpenMP runtime in the
process, torch's; first on macOS); else none, loudly: the kernels then run on one thread.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loom.kernels.dispatch import Variant, machine, runs_here, variants
from loom.threads import available_cpus

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention.c", "layer_ops.c", "argmax.c", "linear_q8.c", "linear_amx.c",
           "linear_bf16.c", "linear_vnni.c", "linear_kquant.c", "linear_kq_gemm.c",
           "decoder_q8.c", "norm_act.c", "gated_delta.c", "mamba2.c", "shortconv.c")
COMMON = ("-O3", "-fPIC", "-Wall", "-Wno-psabi")
FILE_FLAGS = {
    "paged_attention.c": ("-ffast-math",),
    "layer_ops.c": ("-ffast-math",),
    "norm_act.c": ("-ffast-math",),
    "decoder_q8.c": ("-fno-fast-math", "-ffp-contract=off"),
}
IEEE = ("-fno-fast-math", "-ffp-contract=fast")  # every other file
# libmvec holds the vector expf that -ffast-math loops call; not every libc has it
LINK_LIBS = (("-lmvec", "-lm"), ("-lm",))

logger = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """A variant the compiler could not build; the message starts with the compiler's error."""


def cache_dir() -> Path:
    root = os.environ.get("LOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loom"
    )
    return Path(root) / "kernels"


def compiler() -> str | None:
    """$CC or cc, where it exists."""
    cc = os.environ.get("CC") or "cc"
    return cc if shutil.which(cc) else None


@dataclass(frozen=True)
class OpenMP:
    """How `cc` builds the kernels' parallel regions: its compile and link flags."""

    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]

    @property
    def threads(self) -> bool:
        return "-fopenmp" in self.cflags


SERIAL = OpenMP(("-Wno-unknown-pragmas",), ())  # no OpenMP: the kernels run on one thread
PROBE = """#include "loom_omp.h"
int loom_omp_probe(void) {
    int n = 0;
#pragma omp parallel
    {
#pragma omp atomic
        n += omp_get_num_threads() > 0;
    }
    return n;
}
"""


def torch_libomp() -> Path | None:
    """The LLVM OpenMP runtime torch ships, where it does (its macOS wheels: torch/lib/
    libomp.dylib; on Linux it ships GNU's libgomp, which -fopenmp links by its shared name)."""
    spec = importlib.util.find_spec("torch")  # found, not imported
    for d in (spec.submodule_search_locations or []) if spec else []:
        found = sorted((Path(d) / "lib").glob("libomp.*"))
        if found:
            return found[0]
    return None


def share_torch_libomp() -> None:
    """Make the libomp torch has loaded (where it ships one) global, so that kernels built in
    the torch form (openmp_candidates) find its symbols as they load: torch loads it as a
    dependency of its own library, whose symbols stay local. Call before loading the kernels
    (loading an image already loaded returns it; RTLD_GLOBAL then shares its symbols)."""
    lib = torch_libomp()
    if lib is not None:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def openmp_candidates(platform: str = sys.platform) -> list[OpenMP]:
    """The ways to build OpenMP that openmp() tries, in order, before SERIAL: `-fopenmp`, and
    where torch ships libomp, the kernels compiled with `-Xpreprocessor -fopenmp` (the form
    Apple's clang takes) and their OpenMP symbols left to bind, as the library loads, to the
    runtime torch has loaded (macOS: `-undefined dynamic_lookup`; ELF shared objects may leave
    symbols undefined). Not linked by name: torch's libomp.dylib names itself by a path of
    torch's build machine (/opt/llvm-openmp/lib/libomp.dylib in torch 2.13.0's wheel), so a
    library linked to it would not load, and a second libomp (Homebrew's) in the process
    aborts. On macOS the torch form comes first: a clang with its own libomp (Homebrew's
    LLVM) would otherwise load that second copy."""
    own = OpenMP(("-fopenmp",), ("-fopenmp",))
    if torch_libomp() is None:
        return [own]
    torch_form = OpenMP(("-Xpreprocessor", "-fopenmp"),
                        ("-Wl,-undefined,dynamic_lookup",) if platform == "darwin" else ())
    return [torch_form, own] if platform == "darwin" else [own, torch_form]


@functools.cache
def openmp(cc: str) -> OpenMP:
    """The first of openmp_candidates() that `cc` compiles and links a parallel region with,
    else SERIAL (warned: a compiler without OpenMP still builds every kernel, one thread).
    Probed once a process (build_many's `force` probes again), and only where no build of
    a variant exists yet (_located)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(PROBE)
        for omp in openmp_candidates():
            proc = subprocess.run([cc, "-shared", "-fPIC", f"-I{CSRC}", *omp.cflags, str(src),
                                   "-o", str(Path(tmp) / "probe.so"), *omp.ldflags],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                return omp
    logger.info("%s: %s", cc, _first_lines(proc.stderr, 1))
    _serial(cc)
    return SERIAL


@functools.cache
def _serial(cc: str) -> None:  # said once a process, where a build without OpenMP is made or run
    logger.warning("%s builds no OpenMP: Loom's CPU kernels run on one thread; a compiler with "
                   "it (gcc, or clang with libomp; on macOS pip's torch brings the runtime), "
                   "then `python -m loom.kernels.build --force`", cc)


def file_flags(name: str) -> tuple[str, ...]:
    return FILE_FLAGS.get(name, IEEE)


@functools.cache
def _version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


def _key(v: Variant, cc: str, omp: OpenMP) -> str:
    h = hashlib.sha256()
    for s in SOURCES:
        h.update((CSRC / s).read_bytes())
        h.update(" ".join(file_flags(s)).encode())
    for header in sorted(CSRC.glob("*.h")):  # loom.h (the ABI), half.h, loom_omp.h
        h.update(header.read_bytes())
    for part in (" ".join((*COMMON, *omp.cflags, *omp.ldflags, *v.cflags)), _version(cc),
                 v.arch):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _path(v: Variant, cc: str, omp: OpenMP, out_dir: Path | None) -> Path:
    return (out_dir or cache_dir()) / f"loom_{v.arch}_{v.name}_{_key(v, cc, omp)}.so"


def _located(v: Variant, cc: str, out_dir: Path | None = None,
             force: bool = False) -> tuple[Path, OpenMP]:
    """Where variant `v` built by `cc` lies, and its OpenMP form: a build that exists in the
    first form that has one (a start then probes nothing), else (or `force`) the form openmp()
    probes."""
    for omp in () if force else (*openmp_candidates(), SERIAL):
        so = _path(v, cc, omp, out_dir)
        if so.exists():
            if not omp.threads:
                _serial(cc)
            return so, omp
    omp = openmp(cc)
    return _path(v, cc, omp, out_dir), omp


def target(v: Variant, cc: str, out_dir: Path | None = None) -> Path:
    """Where variant `v` built by `cc` lies (whether built or not)."""
    return _located(v, cc, out_dir)[0]


def failed_marker(so: Path) -> Path:
    return so.with_suffix(".failed")


def _first_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line] or lines
    return "\n".join(errors[:n])


def _compile(cc: str, omp: OpenMP, v: Variant, source: str, obj: Path) -> str | None:
    cmd = [cc, *COMMON, *omp.cflags, *v.cflags, *file_flags(source), "-c", str(CSRC / source),
           "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return None if proc.returncode == 0 else f"{source}: {_first_lines(proc.stderr)}"


def _link(cc: str, omp: OpenMP, objs: list[Path], so: Path) -> None:
    out = so.with_suffix(".tmp")
    for libs in LINK_LIBS:
        proc = subprocess.run([cc, "-shared", *map(str, objs), "-o", str(out), *libs,
                               *omp.ldflags], capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(out, so)  # atomic: concurrent builders each write their own
            return
    raise BuildError(f"link: {_first_lines(proc.stderr)}")


def build_many(vs: list[Variant], cc: str | None = None, out_dir: Path | None = None,
               force: bool = False) -> dict[str, Path | BuildError]:
    """Variants `vs`' shared objects, compiled now unless already there (every file of every
    variant in one pool of processes, one a core): name -> the path, or the BuildError that
    disabled it (also kept as a `.failed` marker that later calls return again unless
    `force`). A variant another process is building (a lock file beside it: data-parallel
    replicas starting on a fresh cache, a first use during `make install`) is waited for,
    not built twice."""
    cc = cc or compiler()
    if cc is None:
        return {v.name: BuildError("no C compiler (cc or $CC)") for v in vs}
    if force:
        openmp.cache_clear()  # probed again, once
    done: dict[str, Path | BuildError] = {}
    todo: list[tuple[Variant, Path, OpenMP]] = []
    for v in vs:
        so, omp = _located(v, cc, out_dir, force)
        got = None if force else _existing(so)
        if got is None:
            todo.append((v, so, omp))
        else:
            done[v.name] = got
    if not todo:
        return done
    root = todo[0][1].parent
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        mine, theirs = [], []
        for item in todo:
            lock = held.enter_context(open(item[1].with_suffix(".lock"), "w"))
            (mine if _try_lock(lock) else theirs).append((item, lock))
        done.update(_compile_and_link(cc, [item for item, _ in mine], root))
        for _, lock in mine:  # before waiting on any other builder's: none waits on both
            fcntl.flock(lock, fcntl.LOCK_UN)
        for item, lock in theirs:  # wait for the other builder, then take what it built now
            fcntl.flock(lock, fcntl.LOCK_EX)
            got = _existing(item[1])
            if got is None:  # it stopped before the end: build here
                done.update(_compile_and_link(cc, [item], root))
            else:
                done[item[0].name] = got
    return done


def _try_lock(f) -> bool:  # noqa: ANN001 - an open file
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _existing(so: Path) -> Path | BuildError | None:
    """The build at `so`, or the BuildError its `.failed` marker keeps, or None: neither."""
    if so.exists():
        return so
    marker = failed_marker(so)
    return BuildError(marker.read_text()) if marker.exists() else None


def _compile_and_link(cc: str, todo: list[tuple[Variant, Path, OpenMP]],
                      root: Path) -> dict[str, Path | BuildError]:
    done: dict[str, Path | BuildError] = {}
    if not todo:
        return done
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        jobs = [(omp, v, s, Path(tmp) / f"{v.name}-{s.removesuffix('.c')}.o")
                for v, _, omp in todo for s in SOURCES]
        with ThreadPoolExecutor(available_cpus()) as pool:
            errors = list(pool.map(lambda j: _compile(cc, *j), jobs))
        for v, so, omp in todo:
            mine = [e for (_, jv, _, _), e in zip(jobs, errors) if jv is v and e]
            try:
                if mine:
                    raise BuildError("\n".join(mine))
                _link(cc, omp, [o for _, jv, _, o in jobs if jv is v], so)
            except BuildError as e:
                err = BuildError(f"{cc} could not build the {v.name} kernels "
                                 f"({' '.join(v.cflags)}):\n{e}")
                failed_marker(so).write_text(str(err))
                done[v.name] = err
                continue
            failed_marker(so).unlink(missing_ok=True)
            for old in root.glob(f"loom_{v.arch}_{v.name}_*"):  # older sources, flags, compilers
                if old.stem != so.stem:
                    old.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
            done[v.name] = so
    return done


def build(v: Variant, cc: str | None = None, out_dir: Path | None = None,
          force: bool = False) -> Path:
    """Variant `v`'s shared object (see build_many); BuildError if it cannot be built."""
    got = build_many([v], cc, out_dir, force)[v.name]
    if isinstance(got, BuildError):
        raise got
    return got


def build_all(cc: str | None = None, arch: str | None = None, out_dir: Path | None = None,
              force: bool = False) -> dict[str, Path | BuildError]:
    """Every variant of `arch` (default: this machine's): see build_many."""
    return build_many(variants(arch), cc, out_dir, force)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loom.kernels.build",
                                description="compile Loom's C kernels: the best variant this "
                                "machine runs (the next down where it fails; --all: every "
                                "variant)")
    p.add_argument("--cc", default=None, help="the C compiler (default: $CC or cc)")
    p.add_argument("--arch", default=None, help="x86_64 or aarch64 (default: this machine's)")
    p.add_argument("--out", type=Path, default=None, help=f"folder (default: {cache_dir()})")
    p.add_argument("--all", action="store_true",
                   help="every variant of the architecture, not only those this CPU runs "
                   "(always, for another architecture)")
    p.add_argument("--force", action="store_true", help="rebuild, and retry failed variants")
    ns = p.parse_args(argv)
    if (ns.cc or compiler()) is None:
        print("loom kernels: no C compiler (cc or $CC): Loom runs its torch paths",
              file=sys.stderr)
        return 0
    # a variant this CPU cannot run is never loaded here: built where asked (the suite's
    # build checks, a cache shared with other machines), else where a CPU that runs it is
    arch = ns.arch or machine()
    every = ns.all or arch != machine()
    vs = [v for v in variants(arch) if every or runs_here(v)]
    if every:
        results = build_many(vs, ns.cc, ns.out, ns.force)
    else:  # a process loads one: the best that builds
        results = {}
        for v in vs:
            results[v.name] = build_many([v], ns.cc, ns.out, ns.force)[v.name]
            if not isinstance(results[v.name], BuildError):
                break
    for name, got in results.items():
        if isinstance(got, BuildError):
            print(f"loom kernels: {name} DISABLED: {got}", file=sys.stderr)
        else:
            print(f"loom kernels: {name} built: {got}")
    return 0  # a failed variant is disabled alone; the others (and torch's paths) still run


if __name__ == "__main__":
    sys.exit(main())
