"""Several concurrency levels against one or more servers: the same prompts for every server.

Each (level, repeat) gets its own prompt set (seed + 1000 * repeat + level index), so a repeat
never hits a prefix cache filled by the run before it, and every server sees identical text.
The figure of a level is the median over its repeats.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loom.bench.datasets import BenchPrompt
from loom.bench.metrics import compute_metrics, format_report, notes
from loom.bench.request import RequestInput
from loom.bench.runner import BenchConfig, run_benchmark

PromptSource = Callable[[int, int], list[BenchPrompt]]  # (num_prompts, seed) -> prompts


@dataclass(frozen=True)
class SweepPlan:
    concurrencies: tuple[int, ...] = (1, 4, 16, 32)
    repeats: int = 1
    prompts_per_level: int = 1  # num_prompts = max(prompts_per_level * C, min_prompts)
    min_prompts: int = 4
    seed: int = 0

    def num_prompts(self, concurrency: int) -> int:
        return max(self.prompts_per_level * concurrency, self.min_prompts)

    def seed_for(self, level: int, repeat: int) -> int:
        return self.seed + 1000 * repeat + level


def parse_servers(items: Sequence[str]) -> dict[str, str]:
    """["loom=http://127.0.0.1:8000", ...] -> {"loom": "http://127.0.0.1:8000"}."""
    servers: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"bad --server {item!r}: use NAME=URL, "
                             "e.g. loom=http://127.0.0.1:8000")
        if name in servers:
            raise ValueError(f"--server {name!r} given twice")
        servers[name] = url
    return servers


def parse_concurrencies(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"bad --concurrency {text!r}: use integers like 1,4,16,32") from None
    if not values or min(values) < 1:
        raise ValueError(f"bad --concurrency {text!r}: every level must be at least 1")
    return values


def _median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med: dict[str, Any] = {}
    for key, value in runs[0].items():
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            vals = [r[key] for r in runs if r.get(key) is not None]
            med[key] = statistics.median(vals) if vals else None
    return med


def sweep_server(
    cfg: BenchConfig, plan: SweepPlan, prompts: PromptSource, tokenizer: Any | None = None,
    goodput: dict[str, float] | None = None, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every level `plan.repeats` times against one server; per level runs and medians."""
    levels = []
    for li, conc in enumerate(plan.concurrencies):
        runs = []
        for rep in range(plan.repeats):
            batch = prompts(plan.num_prompts(conc), plan.seed_for(li, rep))
            inputs = [RequestInput(i, p.prompt, p.prompt_len, p.output_len)
                      for i, p in enumerate(batch)]
            res = run_benchmark(replace(cfg, concurrency=conc), inputs, tokenizer)
            m = compute_metrics(res.records, res.duration, goodput)
            log(format_report(m, f"concurrency {conc}, run {rep + 1}/{plan.repeats}"))
            for line in notes(m, cfg.ignore_eos):
                log(line)
            runs.append(m)
        levels.append({"concurrency": conc, "num_prompts": plan.num_prompts(conc),
                       "runs": runs, "median": _median_metrics(runs)})
    return {"url": cfg.base_url, "model": cfg.model, "levels": levels}


def plot_sweep(results: dict[str, dict[str, Any]], path: str | Path, title: str = "") -> None:
    """One PNG: output tokens/s and TTFT p50/p99 vs concurrency, one colour per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, res) in enumerate(results.items()):
        color = f"C{i}"
        conc = [lv["concurrency"] for lv in res["levels"]]
        med = [lv["median"] for lv in res["levels"]]
        ax_tp.plot(conc, [m["output_throughput"] for m in med], "o-", color=color, label=name)
        for stat, style in (("median", "o-"), ("p99", "s--")):
            pts = [(c, m[f"{stat}_ttft_ms"]) for c, m in zip(conc, med)
                   if m.get(f"{stat}_ttft_ms") is not None]
            if pts:
                label = f"{name} {'p50' if stat == 'median' else 'p99'}"
                ax_ttft.plot(*zip(*pts), style, color=color, label=label)
    for ax in (ax_tp, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ticks = sorted({lv["concurrency"] for r in results.values() for lv in r["levels"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_title("output throughput (higher is better)")
    ax_ttft.set_ylabel("time to first token (ms)")
    ax_ttft.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax_ttft.yaxis.set_major_formatter(plain)
    ax_ttft.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(base=10, subs=(2.0, 5.0)))
    ax_ttft.yaxis.set_minor_formatter(plain)
    ax_ttft.set_title("TTFT p50 and p99 (lower is better)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
