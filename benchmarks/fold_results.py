"""Fold benchmark results into benchmarks/results/history.csv; keep the newest run per machine.

    python benchmarks/fold_results.py             # add every result file's figures to history.csv
    python benchmarks/fold_results.py --prune     # ... then delete the runs that are not newest
    python benchmarks/fold_results.py --markdown  # per-machine tables for docs/performance.md

history.csv holds one row per figure: date, commit, machine, run, figure, value. The side-by-side
runs of compare.py (`<date>[-label].md/.json/.png`) give their table's figures per engine
("Loom: output tokens/s @ C=1"); other JSON results (offline-, load-, cpu-, ...) give their
numeric leaves, a list of repeated runs as its median ("loom/output_tokens_per_s"). A run whose
file is gone keeps its rows: the CSV is the history. `--prune` keeps, of each kind (side-by-side,
offline, ...), the newest run per machine (side by side: per machine label and model); kernel
A/B experiments (cpu-*) are history only.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
HISTORY = "history.csv"
FIELDS = ["date", "commit", "machine", "run", "figure", "value"]
DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
# Result files that name no machine: the CPU of the side-by-side runs of the same label and day
# (the Intel runs were labelled amx and lookup; every other run was on the AMD machine).
INTEL = "Intel(R) Xeon(R) Processor, 2 logical cores"
AMD = "AMD EPYC, 2 logical cores"
PRUNED = ("compare", "offline", "cpu")  # kinds --prune thins; the others are single runs


def machine_of(name: str, text: str = "") -> str:
    found = re.search(r"^- CPU: (.+)$", text, re.M)
    if found:
        return found.group(1).strip()
    return INTEL if re.search(r"amx|lookup", name) else AMD


def kind_of(name: str) -> str:
    """compare (side by side), offline, cpu (kernel A/B), load, grammar, ..."""
    if re.match(r"\d{4}-\d{2}-\d{2}", name):
        return "compare"
    return name.split("-", 1)[0]


def kind_of_file(path: Path) -> str:
    """kind_of a result file on disk: compare.py writes a side-by-side run's .md, .json and
    .png together, so a dated file with no .json beside it is a "note" (the AArch64
    instruction counts, say), neither folded as a report nor pruned."""
    kind = kind_of(path.name)
    return "note" if kind == "compare" and not path.with_suffix(".json").exists() else kind


def table_rows(text: str) -> Iterator[tuple[str, str, str]]:
    """(engine, figure, value) of a side-by-side report's table; ratio columns are skipped."""
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None if not line.strip() else header
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(cells[0]) <= {"-", ":"}:
            continue
        for engine, value in zip(header[1:], cells[1:]):
            if "/" in engine or value in ("", "–", "-"):
                continue
            try:
                float(value)
            except ValueError:
                continue
            yield engine, cells[0].rstrip(" ↑↓"), value  # the arrows say which way is better


def _median_of_runs(items: list) -> dict | float | None:
    if items and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
        return statistics.median(items)
    if items and all(isinstance(x, dict) for x in items):
        keys = set.intersection(*(set(x) for x in items))
        return {k: _median_of_runs([x[k] for x in items]) for k in keys}
    return None


def json_leaves(obj: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Numeric leaves as (path, value); lists of repeated runs as their median."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        yield prefix, float(obj)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from json_leaves(obj[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, list):
        if prefix.endswith("records"):
            return  # per-request records: the summary figures beside them say it
        yield from json_leaves(_median_of_runs(obj), prefix)


def _commit_in(text: str) -> str:
    found = re.search(r"Loom: loom [\d.]+ @ ([0-9a-f]{7,})", text) or re.search(
        r'"(?:loom_commit|commit|base)": "([0-9a-f]{7,})"', text)
    return found.group(1) if found else ""


def rows_of(path: Path) -> list[dict[str, str]]:
    """The history rows of one result file ([] for a file that is not a result)."""
    run, text = path.stem, path.read_text(errors="replace")
    date = DATE.search(path.name)
    base = {"date": date.group(1) if date else "", "commit": _commit_in(text),
            "machine": machine_of(path.name, text), "run": run}
    kind = kind_of_file(path)
    if kind == "compare" and path.suffix == ".md":
        figures = [(f"{engine}: {figure}", value) for engine, figure, value in table_rows(text)]
    elif path.suffix == ".json" and kind != "compare":
        try:
            figures = [(k, f"{v:.6g}") for k, v in json_leaves(json.loads(text))]
        except json.JSONDecodeError:
            return []
    else:
        return []
    return [{**base, "figure": f, "value": v} for f, v in figures]


def read_history(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [{**row, "figure": row["figure"].rstrip(" ↑↓")} for row in csv.DictReader(f)]


def write_history(path: Path, rows: list[dict[str, str]]) -> None:
    rows = sorted(rows, key=lambda r: (r["date"], r["run"], r["figure"]), reverse=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def added_at(path: Path) -> int:
    """When git first saw the file (seconds), else its mtime: the order of runs of one day."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%ct", "--", path.name],
                         cwd=path.parent, capture_output=True, text=True).stdout.split()
    return int(out[-1]) if out else int(path.stat().st_mtime)


def subject_of(stem: str) -> str:
    """What a run measured, from its name: the machine label and the model part of a side by
    side run (`2026-12-04-amd-zen3-avx2-2c-smollm2-1.7b-shape-q4_k_m-2` ->
    `amd-zen3-avx2-2c-smollm2-1.7b-shape-q4_k_m`), without its date and its run number or
    commit. Reports' CPU lines name only the vendor and cores (every AMD VM reads alike), so
    runs of different machines and models are told apart by this."""
    rest = re.sub(r"^\d{4}-\d{2}-\d{2}-?", "", stem)
    return re.sub(r"-(\d{1,2}|[0-9a-f]{7})$", "", rest)


def newest_runs(results: Path) -> set[str]:
    """Stems of the newest run of each (kind, machine, subject); kernel A/B runs (cpu-*)
    excluded."""
    best: dict[tuple[str, str, str], tuple[tuple[str, int], str]] = {}
    for path in results.glob("*.json"):
        kind = kind_of(path.name)
        if kind == "cpu":
            continue
        md = path.with_suffix(".md")
        machine = machine_of(path.name, md.read_text() if md.exists() else "")
        key = (kind, machine, subject_of(path.stem) if kind == "compare" else "")
        date = DATE.search(path.name)
        order = (date.group(1) if date else "", added_at(path))
        if key not in best or order > best[key][0]:
            best[key] = (order, path.stem)
    return {stem for _, stem in best.values()}


def markdown(rows: list[dict[str, str]]) -> str:
    """One table per machine of the side-by-side runs, newest first."""
    cols = [("Loom: output tokens/s @ C=1", "tok/s C=1"), ("Loom: output tokens/s @ C=32",
            "tok/s C=32"), ("Loom: TTFT p50 @ C=1 (ms)", "TTFT p50 C=1 (ms)"),
            ("Loom: TTFT p50 @ C=32 (ms)", "TTFT p50 C=32 (ms)"),
            ("Loom: start-up until first token (s)", "start-up (s)"),
            ("Loom: peak memory, RSS of the process tree (MiB)", "peak RSS (MiB)"),
            ("llama.cpp: output tokens/s @ C=1", "llama.cpp tok/s C=1"),
            ("vLLM: output tokens/s @ C=32", "vLLM tok/s C=32")]
    runs: dict[str, dict[str, dict[str, str]]] = {}
    for r in rows:
        if kind_of(r["run"]) == "compare":
            runs.setdefault(r["machine"], {}).setdefault(r["run"], {"_date": r["date"],
                                                                     "_commit": r["commit"]})
            runs[r["machine"]][r["run"]][r["figure"]] = r["value"]
    out = []
    for machine in sorted(runs):
        out.append(f"### {machine}\n")
        out.append("| run | commit | " + " | ".join(short for _, short in cols) + " |")
        out.append("|---|---|" + "---|" * len(cols))
        ordered = sorted(runs[machine].items(), key=lambda kv: (kv[1]["_date"], kv[0]),
                         reverse=True)
        for run, figs in ordered:
            cells = [figs.get(full, "") for full, _ in cols]
            out.append(f"| {run} | {figs['_commit']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--prune", action="store_true", help="delete runs that are not newest")
    p.add_argument("--markdown", action="store_true", help="print the docs' tables and exit")
    ns = p.parse_args(argv)
    history = ns.results / HISTORY
    rows = read_history(history)
    if ns.markdown:
        print(markdown(rows))
        return 0
    present = [path for path in sorted(ns.results.iterdir()) if path.name != HISTORY]
    fresh = [row for path in present for row in rows_of(path)]
    fresh_runs = {row["run"] for row in fresh}
    write_history(history, [r for r in rows if r["run"] not in fresh_runs] + fresh)
    print(f"{history}: {len(fresh)} rows from {len(fresh_runs)} runs")
    if ns.prune:
        keep = newest_runs(ns.results)
        # chosen before any is removed: a report's .md is one while its .json is there
        gone = [path for path in present if kind_of_file(path) in PRUNED and path.stem not in keep]
        for path in gone:
            print(f"folded and removed: {path.name}")
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
