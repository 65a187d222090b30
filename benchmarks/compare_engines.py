"""How compare.py starts each engine: Loom (no flags but `--loom-args`), llama.cpp's and
ik_llama.cpp's `llama-server`, vLLM's CPU build. A peer that is not installed (see
benchmarks/peers/) gives None, with the reason, and the run goes on without it."""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def peers_dir() -> Path:
    """Where benchmarks/peers/install_*.sh put the peers."""
    return Path(os.environ.get("LOOM_PEERS", Path.home() / ".cache" / "loom-peers"))

ENGINES = ("loom", "llama.cpp", "ik_llama.cpp", "vllm")


@dataclass
class Engine:
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    version: str = ""
    notes: str = ""
    weights: Path | None = None  # the file or folder it serves (weight bytes per token)


class NotInstalled(Exception):
    """A peer that cannot run here; the message says why."""


def _out(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return (r.stdout + r.stderr).strip()


def gguf_of(ns: argparse.Namespace) -> Path:
    if ns.model:
        return Path(ns.model).expanduser()
    from loom.loader.resolve import default_gguf_path

    return default_gguf_path()


def _warm_loom() -> None:
    """The C kernels compile on first use after a source change where Loom builds them lazily,
    the modules' bytecode where it is stale: the start-up goal is for a warm machine, so both
    are built before the first round's server is timed."""
    t0 = time.perf_counter()
    try:
        from loom.kernels import cpu_kernels
    except ImportError:  # kernels built at install time: nothing to warm
        cpu_kernels = None
    if cpu_kernels is not None:
        cpu_kernels()
    compileall.compile_dir(str(ROOT / "loom"), quiet=1)
    print(f"Loom's kernels and bytecode ready after {time.perf_counter() - t0:.1f} s", flush=True)


def loom_command(port: int, ns: argparse.Namespace) -> list[str]:
    """`loom serve MODEL --port P`: the defaults a user gets; `--loom-args` adds flags."""
    loom = Path(sys.executable).parent / "loom"
    model = [ns.model] if ns.model else []
    return [str(loom), "serve", *model, "--port", str(port), *shlex.split(ns.loom_args)]


def loom_engine(port: int, ns: argparse.Namespace) -> Engine:
    cmd = loom_command(port, ns)
    rev = _out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = " (uncommitted changes)" if _out(["git", "-C", str(ROOT), "status", "--porcelain",
                                                "--untracked-files=no"]) else ""
    import torch

    from loom import __version__

    _warm_loom()
    flags = f"flags: {ns.loom_args}" if ns.loom_args.strip() else "no flags (defaults)"
    return Engine("Loom", cmd,
                  version=f"loom {__version__} @ {rev}{dirty}, torch {torch.__version__}",
                  notes=f"{gguf_of(ns).name}; {flags}", weights=gguf_of(ns))


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def _llama_server(name: str, server: Path, port: int, ns: argparse.Namespace,
                  extra: str, package: str) -> Engine:
    """llama.cpp's own server binary (not a package's wrapper script), the same flags for both
    builds: one slot per stream of the highest level, continuous batching, one thread a core."""
    slots = max(ns.concurrency)
    gguf = gguf_of(ns)
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-cb", "-t", str(ns.threads), "-c", str(slots * ns.slot_context),
           *shlex.split(extra)]
    notes = ""
    if name == "llama.cpp" and "amx_int8" in _cpu_flags():
        # On AMX CPUs llama.cpp moves the weights to its AMX buffer type, whose Q4_1 kernel
        # (tinygemm_kernel_amx) dies of SIGILL here on the first prompt; --no-repack keeps the
        # weights in its regular CPU buffers (AVX-512 VNNI dot products), which run.
        cmd.append("--no-repack")
        notes = "; --no-repack (its AMX path crashes on this CPU)"
    built = _out([str(server), "--version"]).splitlines()
    version = f"{package} (llama-server {' '.join(v for v in built if 'version' in v)})"
    return Engine(name, cmd, version=version, weights=gguf,
                  notes=f"same GGUF; {slots} slots of {ns.slot_context} tokens, continuous "
                        f"batching, {ns.threads} threads{notes}")


def llama_cpp_engine(port: int, ns: argparse.Namespace) -> Engine:
    server = peers_dir() / "llama-cpp" / "bin" / "llama-server"
    if not server.is_file():
        raise NotInstalled("not installed (bash benchmarks/peers/install_llama_cpp.sh)")
    package = server.with_name("PACKAGE")
    package = package.read_text().strip() if package.is_file() else "llama.cpp"
    return _llama_server("llama.cpp", server, port, ns, ns.llama_args, package)


def ik_llama_cpp_engine(port: int, ns: argparse.Namespace) -> Engine:
    server = peers_dir() / "ik-llama-cpp" / "bin" / "llama-server"
    if not server.is_file():
        raise NotInstalled("not installed (bash benchmarks/peers/install_ik_llama_cpp.sh)")
    src = sorted((peers_dir() / "ik-llama-cpp" / "src").glob("ik_llama_cpp_python-*"))
    package = f"ik_llama.cpp from {src[-1].name}" if src else "ik_llama.cpp"
    return _llama_server("ik_llama.cpp", server, port, ns, ns.ik_args, package)


def vllm_model(ns: argparse.Namespace) -> Path | None:
    """The Hugging Face folder vLLM serves: --vllm-model, else the packaged model's conversion
    by install_vllm_cpu.sh, else (another GGUF) none."""
    if ns.vllm_model:
        return Path(ns.vllm_model).expanduser()
    return None if ns.model else peers_dir() / "smollm2-hf"


def vllm_engine(port: int, ns: argparse.Namespace) -> Engine:
    python, model = peers_dir() / "vllm-cpu" / "bin" / "python", vllm_model(ns)
    if not python.is_file():
        raise NotInstalled("not installed (bash benchmarks/peers/install_vllm_cpu.sh)")
    if model is None:
        raise NotInstalled("no Hugging Face folder of this model for it (--vllm-model DIR)")
    if not (model / "config.json").is_file():
        raise NotInstalled(f"its model folder {model} is missing")
    config = json.loads((model / "config.json").read_text())
    dtype = ns.vllm_dtype or config.get("torch_dtype") or config.get("dtype") or "auto"
    # Not the `vllm` console script: in the vllm-cpu distribution it fails on its own --version.
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(ns.max_model_len), *shlex.split(ns.vllm_args)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(ns.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": ns.vllm_threads_bind}
    version = _out([str(python), "-c",
                    "import vllm, torch; print(vllm.__version__, torch.__version__)"])
    if "Error" in version:
        raise NotInstalled(f"does not import: {version.splitlines()[-1]}")
    v, _, torch_v = version.splitlines()[-1].partition(" ")
    src = model / "loom_source.json"
    origin = json.loads(src.read_text()).get("gguf", "") if src.is_file() else ""
    return Engine("vLLM", cmd, env, version=f"vllm-cpu {v}, torch {torch_v}", weights=model,
                  notes=f"{Path(origin).name or model.name} dequantized to {dtype} "
                        "(benchmarks/peers/)")


MAKERS = {"loom": loom_engine, "llama.cpp": llama_cpp_engine,
          "ik_llama.cpp": ik_llama_cpp_engine, "vllm": vllm_engine}
