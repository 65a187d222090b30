"""CPU A/B on SmolLM2: this checkout against a base revision, runs interleaved (base, new, base,
new ...) so both see the same machine load; medians and ratios. On a shared machine only the
ratios mean something.

    .venv/bin/python benchmarks/bench_cpu_ab.py startup --base 76fb812 --repeats 3
    .venv/bin/python benchmarks/bench_cpu_ab.py decode --base 76fb812 --repeats 3 \
        --variant base: --variant new: --variant new:int4

`startup`: `loom serve` until the first streamed token (`loom bench startup`), and
`loom generate --max-tokens 1` until it exits. `decode`: greedy tokens/s of 1 and 8 streams
(`--streams`) after a 150-token prompt, and the time to prefill that many uncached 150-token
prompts and sample one token (`prefill_ms`), one fresh process per run. The base runs from a
`git worktree` in a temporary folder (the working tree is never touched). `startup` runs each
side's own CLI (with the OpenMP policy it sets); `decode` runs both sides under this process's
environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

sys.path.insert(0, str(REPO / "benchmarks"))
from _common import free_port  # noqa: E402

# One decode measurement; run with the checkout under test as the working directory (its
# `loom` package shadows the installed one).
_DECODE = """
import json, logging, os, sys, time
sys.path.insert(0, os.getcwd())
logging.disable(logging.INFO)
from loom import LLM, SamplingParams
# e.g. int8+bf16: the quantization, then a --cpu-kernels build
quant, _, kernels = os.environ.get("LOOM_AB_QUANT", "").partition("+")
llm = LLM(quantization=quant or None, max_model_len=1024, kv_cache_memory=2**30,
          **({"cpu_kernels": kernels} if kernels else {}))
prompt = llm.get_tokenizer().encode("The history of the Roman Empire is long. " * 20)[:150]
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
out = {}
for streams in json.loads(os.environ["LOOM_AB_STREAMS"]):
    llm.generate([prompt] * streams, one, use_tqdm=False)
    t = time.perf_counter(); llm.generate([prompt] * streams, one, use_tqdm=False)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt] * streams, SamplingParams(temperature=0, max_tokens=65, ignore_eos=True),
                 use_tqdm=False)
    s = "" if streams == 1 else "s"
    out[f"tok_s_{streams}_stream{s}"] = streams * 64 / (time.perf_counter() - t - prefill)
    # Prefill alone: prompts no earlier step has seen (a distinct first token each), so the
    # prefix cache cannot serve them.
    fresh = [[1000 + 64 * streams + i] + prompt[1:] for i in range(streams)]
    t = time.perf_counter(); llm.generate(fresh, one, use_tqdm=False)
    out[f"prefill_ms_{streams}_stream{s}"] = (time.perf_counter() - t) * 1e3
print("RESULT " + json.dumps(out))
"""


def _startup_once(tree: Path) -> dict[str, float]:
    # The measuring `loom bench` sets its OpenMP defaults for itself: the server must not inherit
    # them (each side's CLI sets its own).
    port = free_port()
    serve = f"cd {tree} && exec env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT {PYTHON} " \
            f"-m loom.entrypoints.cli serve " \
            f"--port {port}"
    out = subprocess.run(
        [PYTHON, "-m", "loom.entrypoints.cli", "bench", "startup", "--base-url",
         f"http://127.0.0.1:{port}", "--timeout", "300", "--", "bash", "-c", serve],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    first = float(re.search(r"first token after ([\d.]+) s", out).group(1))  # type: ignore[union-attr]
    t = time.perf_counter()
    subprocess.run([PYTHON, "-m", "loom.entrypoints.cli", "generate", "The capital of France is",
                    "--max-tokens", "1"], cwd=tree, capture_output=True, check=True)
    return {"serve_first_token_s": first, "generate_s": time.perf_counter() - t}


def _decode_once(tree: Path, quant: str, streams: list[int]) -> dict[str, float]:
    # The Python API sets no OpenMP policy: both sides run under this process's environment
    # (export OMP_WAIT_POLICY to compare under one).
    env = {**os.environ, "LOOM_AB_QUANT": quant, "LOOM_AB_STREAMS": json.dumps(streams)}
    out = subprocess.run([PYTHON, "-c", _DECODE], cwd=tree, env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.split("RESULT ", 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["startup", "decode"])
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", action="append", default=None, metavar="SIDE:QUANT",
                   help="decode: base: | new: | new:fp16 | new:int8 | new:int4 | "
                        "new:int8+bf16 (a --cpu-kernels build after +) (default: base: new:)")
    p.add_argument("--streams", default="1,8",
                   help="decode: concurrent streams, comma-separated")
    p.add_argument("--result-json", default=None)
    ns = p.parse_args()
    streams = [int(n) for n in ns.streams.split(",")]
    variants = [tuple(v.split(":", 1)) for v in (ns.variant or ["base:", "new:"])]
    if ns.what == "startup":
        variants = [("base", ""), ("new", "")]
    name = {(s, q): f"{s}:{q or 'fp32'}" for s, q in variants}
    runs: dict[str, list[dict[str, float]]] = {name[v]: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), ns.base], cwd=REPO,
                       check=True)
        try:
            for i in range(ns.repeats):
                for side, quant in variants:
                    tree = REPO if side == "new" else base
                    r = (_startup_once(tree) if ns.what == "startup"
                         else _decode_once(tree, quant, streams))
                    runs[name[side, quant]].append(r)
                    print(f"run {i + 1} {name[side, quant]} " + ", ".join(
                        f"{k} {v:.2f}" for k, v in r.items()), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO)
    first = next(iter(runs))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    for k, figures in med.items():
        print(f"median {k}: " + ", ".join(
            f"{m} {v:.2f} ({v / med[first][m]:.2f}x {first})" for m, v in figures.items()))
    if ns.result_json:
        Path(ns.result_json).write_text(json.dumps(
            {"what": ns.what, "base": ns.base, "runs": runs, "medians": med}, indent=2) + "\n")


if __name__ == "__main__":
    main()
