"""Loom side by side with llama.cpp's `llama-server`, ik_llama.cpp's and vLLM's CPU build, on the
same machine, the same model, the same client (`loom bench`) and the same prompts, in one run.

For each round, each engine in turn: start its server, time /health and the first token, run
the sweep (by default concurrency 1, 4, 16, 32; 128-token prompts; 128 output tokens,
ignore_eos), sample the memory of its process tree all along, stop it. Loom runs as
`loom serve MODEL --port P` with no other flag unless --loom-args gives some. Figures are medians
over the rounds; beside them the machine's memory read bandwidth, the weight bytes each engine
reads per token and the share of that bandwidth its one-stream decode sustains, and (--goals)
the issue's goals against the best peer. Writes benchmarks/results/<date>[-label].md (+ .json
with every run, + .png); a second run of a label in one day writes <date>-<label>-2.md beside
the first (-3, ...), so neither report nor its history.csv rows are lost.

    .venv/bin/python benchmarks/compare.py            # 3 rounds, the packaged SmolLM2 Q4_1
    .venv/bin/python benchmarks/compare.py --quick    # 1 round, fewer requests per level
    .venv/bin/python benchmarks/compare.py --model FILE.gguf [--vllm-model HF_DIR] --label NAME
    bash benchmarks/run_side_by_side.sh               # every model of issue 32 / 26, ~30 min

Peers come from benchmarks/peers/install_*.sh (under $LOOM_PEERS, default ~/.cache/loom-peers);
those not installed are skipped with a note in the report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port  # noqa: E402
from compare_engines import ENGINES, MAKERS, ROOT, Engine, NotInstalled, gguf_of  # noqa: E402
from compare_figures import GOALS, goal_lines, read_bandwidth, weight_bytes  # noqa: E402


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
        # every engine idles as long before its sweep: a server's work after its start
        # (Loom moves its weights onto huge pages while idle) is done, as in a server that
        # has been up a while
        time.sleep(ns.settle)
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


def warm_start(eng: Engine, port: int, ns: argparse.Namespace) -> None:
    """Starts `eng` until /health and stops it, unmeasured: its program and model files then
    sit in the page cache, as on any start but a machine's first, so the measured start-ups
    compare the engines' own work rather than which one the disk served first (on a fresh VM
    the first engine started took 5-9 s where a second start took 1-3)."""
    url = f"http://127.0.0.1:{port}"
    log = Path(f"/tmp/loom-compare-{eng.name}-warm.log")
    with ServerProcess(eng.cmd, url, env=eng.env, log_path=log) as server:
        try:
            print(f"{eng.name}: warm start, /health after "
                  f"{server.wait_healthy(ns.start_timeout):.2f} s (not counted)", flush=True)
        except ServerStartError as e:
            print(f"{eng.name}: warm start failed ({e}); its measured start will say", flush=True)


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(rounds: list[dict[str, Any]], name: str, wbytes: int | None = None,
              bandwidth: float | None = None) -> dict[str, Any]:
    """Medians over rounds: start-up, memory, and each level's median figures; with the weight
    bytes and the machine's read bandwidth, the share of it the one-stream decode sustains
    (decode steps a second, 1000 / TPOT p50, times the bytes)."""
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
    s["weight_bytes"] = wbytes
    # the decode's own rate, 1000 / TPOT: output tokens/s counts the prompt's time too (a 1.7B
    # model's 128-token prompt is a third of a 64-token answer's time on 2 cores), which reads
    # no more weights than one decode step
    tpot = next((lv["median"].get("median_tpot_ms") for lv in levels
                 if lv["concurrency"] == 1), None)
    s["bandwidth_share"] = (1000.0 / tpot * wbytes / bandwidth
                            if tpot and wbytes and bandwidth else None)
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
    ("weights read per token (MiB)", "weight_bytes", False, 2**-20, None),
    ("one-stream decode, share of the read bandwidth (%)", "bandwidth_share", False, 100.0,
     True),
    ("CPU used by the server during the sweep (cores)", "server_cpu_cores", False, 1.0, None),
    ("CPU used by other processes during the sweep (cores)", "other_load_cores", False, 1.0, None),
]


def _cell(s: dict[str, Any], key: str, c: int | None, scale: float) -> float | None:
    if c is not None:
        lv = next((x for x in s["levels"] if x["concurrency"] == c), None)
        v = lv["median"].get(key) if lv else None
    else:
        v = s.get(key)
    return None if v is None else v * scale


def table(summary: dict[str, dict[str, Any]], concurrencies: list[int]) -> list[str]:
    """Every figure per engine, then Loom / each peer and Loom / the best peer of that figure."""
    names = [n for n in summary if summary[n]]
    peers = [n for n in names if n != "Loom"]
    ratio_cols = [f"Loom/{p}" for p in peers] + (["Loom/best peer"] if len(peers) > 1 else [])
    head = ["figure", *names, *ratio_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, per_level, scale, higher in FIGURES:
        for c in (concurrencies if per_level else [None]):
            vals = {n: _cell(summary[n], key, c, scale) for n in names}
            if all(v is None for v in vals.values()):
                continue
            mark = "" if higher is None else (" ↑" if higher else " ↓")
            cells = [label.format(c=c) + mark]
            cells += ["–" if vals[n] is None else _fmt(vals[n], key) for n in names]
            lo = vals.get("Loom")
            usable = higher is not None and key != "failed" and lo is not None
            for p in peers:
                cells.append(f"{lo / vals[p]:.2f}" if usable and vals[p] else "–")
            if len(peers) > 1:
                pv = [vals[p] for p in peers if vals[p]]
                best = (max if higher else min)(pv) if pv else None
                cells.append(f"{lo / best:.2f}" if usable and best else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt(v: float, key: str) -> str:
    if key == "failed":
        return str(int(v))
    return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"


def machine_info(bandwidth: dict[str, float]) -> list[str]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0)
    flags = Path("/proc/cpuinfo").read_text()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")
           if f" {f}" in flags]
    lines = [f"- CPU: {cpu}, {os.cpu_count()} logical cores", f"- ISA: {', '.join(isa) or '?'}",
             f"- memory: {mem / 2**20:.1f} GiB", f"- OS: {platform.platform()}",
             f"- Python {platform.python_version()}"]
    if bandwidth:
        lines.append("- memory read bandwidth (sum over a 1 GiB float32 array, best of 5): "
                     + ", ".join(f"{v / 1e9:.1f} GB/s with {k}" for k, v in bandwidth.items()))
    return lines


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


def model_name(ns: argparse.Namespace) -> str:
    return ns.model_name or (gguf_of(ns).name if ns.model else "SmolLM2-135M-Instruct Q4_1")


def write_report(path: Path, ns: argparse.Namespace, engines: list[Engine],
                 summary: dict[str, dict[str, Any]], skipped: list[str], png: Path,
                 rounds: list[dict[str, Any]], started: str, elapsed: float,
                 bandwidth: dict[str, float]) -> None:
    conc = list(ns.concurrency)
    failed = {n: r[n].get("error") for r in rounds for n in r if r[n].get("error")}
    setup = (f"Same machine, same model ({model_name(ns)}), same client (`loom bench`), same "
             f"prompts, one run: {ns.input_len}-token synthetic prompts, {ns.output_len} output "
             "tokens per request (`ignore_eos`), greedy, streamed over loopback; concurrency "
             f"{', '.join(map(str, conc))}; requests per level: max({ns.prompts_per_level} x C, "
             f"{ns.min_prompts}). Figures are medians over {ns.rounds} round(s); in each round "
             "every engine is started, measured and stopped in turn"
             + ("" if ns.cold else " (each was started once, unmeasured, before the first round:"
                " start-up figures are warm starts, the files in the page cache)")
             + ". Loom runs "
             + (f"with `{ns.loom_args}`." if ns.loom_args.strip() else "with no flags."))
    if ns.quick:
        setup += " **Quick run (`--quick`): one round, fewer requests; indicative only.**"
    reading = ("Ratios are Loom / peer: above 1 is better for Loom where the figure is marked ↑, "
               "below 1 where it is marked ↓; `Loom/best peer` holds Loom against the best peer "
               "of each figure. Memory is sampled over the server's whole life "
               "(start-up and sweep) and summed over its process tree: RSS every 0.25 s, PSS "
               "(which counts pages shared between its processes once) every 5 s. Weights read "
               "per token: the served file's tensors (for Loom too, whatever it holds them as "
               "in memory; the embedding table counts only where it is also the output head); "
               "the bandwidth share is one-stream decode steps a second (1000 / TPOT p50) x "
               "those bytes over the machine's read bandwidth (all cores, below).")
    lines = [f"# Loom side by side with its peers — {model_name(ns)}, {started}", "", setup, "",
             reading, "", *_load_warning(summary), *table(summary, conc), ""]
    goals = goal_lines(summary, ns.goals)
    if goals:
        lines += [f"Goals of `loom serve MODEL` (no flags), against the peers of this run "
                  f"({ns.goals}):", "", *goals, ""]
    lines += [f"![output tokens/s and TTFT vs concurrency]({png.name})", ""]
    if skipped or failed:
        lines += ["## Not measured", ""]
        lines += [f"- {s}" for s in skipped]
        lines += [f"- {n}: {e.splitlines()[0]}" for n, e in failed.items()]
        lines.append("")
    lines += ["## Machine", "", *machine_info(bandwidth), "", "## Versions", ""]
    lines += [f"- {e.name}: {e.version}; {e.notes}" for e in engines]
    this = shlex.join([".venv/bin/python", _short(str(Path(sys.argv[0]).resolve())),
                       *sys.argv[1:]])
    lines += ["", "## Commands", "", "```", f"{this}   # took {elapsed / 60:.1f} min",
              "# servers, as started by it (ports vary):"]
    for e in engines:
        env = " ".join(f"{k}={v}" for k, v in e.env.items())
        lines.append(_short(f"{env + ' ' if env else ''}{shlex.join(e.cmd)}"))
    data = path.name.removesuffix(".md") + ".json"
    lines += ["```", "", f"Every run's figures, per level and round, are in [{data}]({data}).", ""]
    path.write_text("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round and at most C requests a level")
    p.add_argument("--rounds", type=int, default=3, help="start-measure-stop rounds (median)")
    p.add_argument("--engines", default="loom,llama.cpp,ik_llama.cpp,vllm",
                   help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--model", default=None,
                   help="a GGUF file for Loom and the llama.cpp builds (default: the packaged "
                        "SmolLM2 Q4_1)")
    p.add_argument("--vllm-model", default=None,
                   help="vLLM's Hugging Face folder of the same weights (default: for the "
                        "packaged model, $LOOM_PEERS/smollm2-hf; for another, vLLM is skipped)")
    p.add_argument("--model-name", default=None, help="the model as the report names it")
    p.add_argument("--label", default=None,
                   help="result files are <date>-<label>.* (default: the GGUF's stem, if any)")
    p.add_argument("--goals", default=None, choices=[*GOALS, "none"],
                   help="the issue goals to check (default: 135m for the packaged model)")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-level", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="the llama.cpp builds' threads (default: one per core)")
    p.add_argument("--slot-context", type=int, default=512,
                   help="the llama.cpp builds' context per slot")
    p.add_argument("--llama-args", default="", help="extra llama.cpp `llama-server` flags")
    p.add_argument("--ik-args", default="-fa off",
                   help="extra ik_llama.cpp `llama-server` flags (default '-fa off': its flash "
                        "attention, on by default, stops on GGML_ASSERT(S > 0) in "
                        "iqk_fa_templates.h on the first prompt here, AVX-512, sdist 0.1.5)")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM's")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's KV-cache space")
    p.add_argument("--vllm-dtype", default=None,
                   help="vLLM's --dtype (default: its folder's config torch_dtype)")
    p.add_argument("--vllm-threads-bind", default=f"0-{(os.cpu_count() or 2) - 1}",
                   help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    p.add_argument("--loom-args", default="",
                   help="`loom serve` flags (default none: the goals are for the defaults), "
                        "e.g. '--max-model-len 2048 --kv-cache-memory 1GiB'")
    p.add_argument("--no-bandwidth", action="store_true",
                   help="skip the memory read bandwidth measurement")
    p.add_argument("--wait-quiet", type=float, default=600.0,
                   help="before each engine, wait up to this many seconds for other processes "
                        "to go under 0.3 busy cores")
    p.add_argument("--cold", action="store_true",
                   help="no unmeasured warm start of each engine before the rounds")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--settle", type=float, default=15.0,
                   help="seconds each server idles after its first token, before the sweep")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ns = p.parse_args(argv)
    ns.concurrency = tuple(int(c) for c in ns.concurrency.split(","))
    unknown = [e for e in ns.engines.split(",") if e.strip() and e.strip() not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; use {','.join(ENGINES)}")
    if ns.goals is None:
        ns.goals = "none" if ns.model else "135m"
    if ns.quick:
        ns.rounds, ns.prompts_per_level, ns.min_prompts, ns.cold = 1, 1, 2, True
    return ns


def measure_bandwidth(ns: argparse.Namespace) -> dict[str, float]:
    if ns.no_bandwidth:
        return {}
    wait_for_quiet(ns.wait_quiet)
    cores = os.cpu_count() or 1
    bw = {f"{cores} threads": read_bandwidth(), "1 thread": read_bandwidth(threads=1)}
    print("memory read bandwidth: " + ", ".join(f"{v / 1e9:.1f} GB/s with {k}"
                                                for k, v in bw.items()), flush=True)
    return bw


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    started = time.strftime("%Y-%m-%d")
    t_start = time.perf_counter()
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = ns.label or (Path(ns.model).stem if ns.model else "")
    stem = base = f"{started}-{label}" if label else started  # may hold dots: "...-1.7b-shape"
    for n in itertools.count(2):  # a second run of a label in a day goes beside the first
        if not (out_dir / f"{stem}.md").exists():  # (fold_results.py keys history by name)
            break
        stem = f"{base}-{n}"
    md, data, png = (out_dir / f"{stem}{ext}" for ext in (".md", ".json", ".png"))
    wanted = [e.strip() for e in ns.engines.split(",") if e.strip()]
    ports = {name: free_port() for name in wanted}
    engines, skipped = [], []
    for name in wanted:
        try:
            engines.append((MAKERS[name](ports[name], ns), ports[name]))
        except NotInstalled as e:
            skipped.append(f"{name}: {e}")
            print(f"skipping {name}: {e}", flush=True)
    tokenizer = load_tokenizer(ns.model)
    vocab = normal_token_ids(tokenizer)

    def source(n: int, seed: int) -> list[Any]:
        return synthetic_prompts(tokenizer, n, ns.input_len, ns.output_len, seed, vocab)

    bandwidth = measure_bandwidth(ns)
    if not ns.cold:
        for eng, port in engines:
            warm_start(eng, port, ns)
    rounds: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        plan = SweepPlan(ns.concurrency, 1, ns.prompts_per_level, ns.min_prompts,
                         ns.seed + 1000 * r)
        results = {}
        for eng, port in engines:
            log = Path(f"/tmp/loom-compare-{eng.name}-{r}.log")
            results[eng.name] = run_engine(eng, port, plan, source, tokenizer, ns, log)
            # kept after every engine, so an interrupted run leaves what it measured
            data.write_text(json.dumps(
                {"args": vars(ns), "bandwidth_bytes_per_s": bandwidth, "skipped": skipped,
                 "rounds": [*rounds, results]}, indent=1) + "\n")
        rounds.append(results)
    all_cores = next(iter(bandwidth.values()), None)
    summary = {e.name: summarize(rounds, e.name, weight_bytes(e.weights), all_cores)
               for e, _ in engines}
    data.write_text(json.dumps(
        {"args": vars(ns), "bandwidth_bytes_per_s": bandwidth, "skipped": skipped,
         "commands": {e.name: {"cmd": e.cmd, "env": e.env} for e, _ in engines},
         "summary": summary, "rounds": rounds}, indent=1) + "\n")
    measured = {n: s for n, s in summary.items() if s}
    if measured:
        plot_sweep(measured, png, f"{model_name(ns)}, {ns.input_len}-token prompts, "
                                  f"{ns.output_len} output tokens, median of {ns.rounds} round(s)")
    write_report(md, ns, [e for e, _ in engines], summary, skipped, png,
                 rounds, started, time.perf_counter() - t_start, bandwidth)
    print(f"\nwrote {md}, {png.name}, {data.name}")
    print(md.read_text())


if __name__ == "__main__":
    main()
