"""The figures of vLLM's `bench serve`, computed from the request records.

Definitions (all latencies over successful requests only; times in ms in the output):
  TTFT  first text chunk - request start
  TPOT  (E2E - TTFT) / (output tokens - 1), per request with at least 2 output tokens
  ITL   gaps between consecutive text chunks, pooled over all requests
  E2E   end of the stream - request start
  throughput  tokens (or requests) of successful requests / benchmark duration
  goodput     successful requests meeting every SLO given / benchmark duration
Percentiles are numpy's linear interpolation, as in vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from loom.bench.request import RequestRecord

LATENCY_FIGURES = ("ttft", "tpot", "itl", "e2el")
STAT_NAMES = ("mean", "median", "p90", "p99")
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


class SLOError(ValueError):
    """A --goodput argument that is not NAME:MILLISECONDS with a known name."""


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise SLOError(f"bad --goodput {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise SLOError(f"bad --goodput {item!r}: {value!r} is not a number") from None
        if slos[name] <= 0:
            raise SLOError(f"bad --goodput {item!r}: the limit must be positive")
    return slos


def _stats(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {s: None for s in STAT_NAMES}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds, per figure, from the successful records."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def _meets(rec: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slos.items())


def compute_metrics(
    records: list[RequestRecord], duration: float, goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A flat dict: counts, throughputs and `{stat}_{figure}_ms` for every figure and stat."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(failed), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": (sum(_meets(r, goodput) for r in ok) / dur) if goodput else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "short_outputs": sum(r.output_tokens < r.output_len for r in ok),
        "usage_reported": sum(r.usage_reported for r in ok),
        "errors": dict(Counter(r.error for r in failed).most_common(5)),
    }
    for figure, values in latency_samples(records).items():
        for stat, value in _stats(values).items():
            out[f"{stat}_{figure}_ms"] = value
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def format_report(m: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The result block vLLM's `bench serve` prints."""
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Benchmark duration (s):", m["duration"]),
            ("Total input tokens:", m["total_input_tokens"]),
            ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", m["request_throughput"])]
    if m.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", m["request_goodput"]))
    rows += [("Output token throughput (tok/s):", m["output_throughput"]),
             ("Total token throughput (tok/s):", m["total_token_throughput"])]
    lines = [f"{' ' + title + ' ':=^50}"] + [f"{k:<40}{_fmt(v)}" for k, v in rows]
    for figure in LATENCY_FIGURES:
        lines.append(f"{' ' + _TITLES[figure] + ' ':-^50}")
        name = figure.upper()
        for stat in STAT_NAMES:
            shown = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            label = f"{shown} {name} (ms):"
            lines.append(f"{label:<40}{_fmt(m[f'{stat}_{figure}_ms'])}")
    lines.append("=" * 50)
    return "\n".join(lines)


def notes(m: dict[str, Any], ignore_eos: bool) -> list[str]:
    """Warnings a reader needs next to the figures: failures, short outputs, counting method."""
    out = []
    if m["failed"]:
        out.append(f"{m['failed']} request(s) failed:")
        out += [f"  {n} x {msg}" for msg, n in m["errors"].items()]
    if m["short_outputs"]:
        why = ("the server may not honour ignore_eos" if ignore_eos
               else "they stopped at end-of-sequence; pass --ignore-eos for exact lengths")
        out.append(f"note: {m['short_outputs']} of {m['completed']} successful request(s) "
                   f"returned fewer tokens than asked ({why})")
    if m["completed"] and m["usage_reported"] < m["completed"]:
        out.append("note: the server did not report usage for "
                   f"{m['completed'] - m['usage_reported']} request(s); their output tokens "
                   "were counted with the tokenizer")
    return out
