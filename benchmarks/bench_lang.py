"""A fork-heavy loom.lang program against the same requests sent naively one after another.

The program: a `--context-tokens` context, then `--branches` forks, each generating
`--max-tokens` tokens (ignore_eos, so every mode does the same decoding). Three modes on the
default model, in this process, interleaved within each round (a fresh context per round, so
no round finds the last one's blocks):

- lang: the program on an EngineBackend (prefix cache on): the branches go in together.
- naive: the branches' full prompts through `LLM.generate`, one request at a time, on an engine
  without prefix caching (what a client of an engine without sharing gets).
- naive+cache: the same one-at-a-time requests on an engine with prefix caching (sequential, so
  prefill is shared but decoding is not batched).

Reported per mode (median over rounds): prompt tokens computed (prompt tokens minus prefix-cache
hits, from the engine's counters) and wall time; ratios against naive. The issue's goals: >= 3x
less prefill work and >= 2x faster end to end. Outputs are checked equal across modes (greedy).

    .venv/bin/python benchmarks/bench_lang.py --out benchmarks/results/lang-<date>.json
    .venv/bin/python benchmarks/bench_lang.py --context-tokens 64 --branches 2 --max-tokens 4 \
        --rounds 1      # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from loom import LLM, SamplingParams
from loom.lang import EngineBackend, function, gen

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dump, machine, median_of  # noqa: E402

WORDS = ("river mill harbor lantern copper orchard signal meadow glacier ledger compass "
         "violet thunder marble falcon cedar quarry beacon tundra saffron").split()


def make_context(llm: LLM, round_no: int, num_tokens: int) -> str:
    """Deterministic prose of exactly `num_tokens` tokens (re-encoded), different per round."""
    words = [WORDS[(i * 7 + round_no * 3 + i // 20) % len(WORDS)] for i in range(num_tokens * 2)]
    tok = llm.get_tokenizer()
    ids = tok.encode(f"Round {round_no}. " + " ".join(words))[:num_tokens]
    return tok.decode(ids)


def branch_suffix(i: int) -> str:
    return f"\nIdea {i + 1}:"


@function
def tree(s, context: str, branches: int, max_tokens: int):
    s += context
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += branch_suffix(i) + gen("idea", max_tokens=max_tokens, ignore_eos=True)
    forks.join()
    return forks


def counters(llm: LLM) -> tuple[int, int]:
    """(prompt tokens received, prompt tokens served by the prefix cache)."""
    return (llm.engine.stats.prompt_tokens_total,
            llm.engine.scheduler.prefix_cache_stats.hits)


def run_lang(llm: LLM, context: str, branches: int, max_tokens: int) -> tuple[dict, list[str]]:
    """The program on an EngineBackend; its branches' generations in branch order."""
    prompt0, hits0 = counters(llm)
    holder: dict[str, Any] = {}

    @function
    def keep(s):
        holder["forks"] = tree(s, context, branches, max_tokens)

    with EngineBackend(llm) as backend:
        t0 = time.perf_counter()
        keep.run(backend=backend)
        texts = [f["idea"] for f in holder["forks"]]
        wall = time.perf_counter() - t0
    prompt, hits = counters(llm)
    return {"prompt_tokens_computed": (prompt - prompt0) - (hits - hits0), "seconds": wall}, texts


def run_naive(llm: LLM, context: str, branches: int, max_tokens: int) -> tuple[dict, list[str]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt0, hits0 = counters(llm)
    t0 = time.perf_counter()
    texts = [llm.generate(context + branch_suffix(i), params, use_tqdm=False)[0].outputs[0].text
             for i in range(branches)]
    wall = time.perf_counter() - t0
    prompt, hits = counters(llm)
    return {"prompt_tokens_computed": (prompt - prompt0) - (hits - hits0), "seconds": wall}, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=1000)
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()

    engine_kwargs = {"max_model_len": args.context_tokens + args.max_tokens + 64}
    cached = LLM(**engine_kwargs)
    uncached = LLM(enable_prefix_caching=False, **engine_kwargs)
    for llm in (cached, uncached):  # first-call costs (kernel set-up, page faults) off the clock
        llm.generate("Warm up.", SamplingParams(max_tokens=2), use_tqdm=False)
    runs: dict[str, list[dict]] = {"lang": [], "naive": [], "naive+cache": []}
    for r in range(args.rounds):
        context = make_context(cached, r, args.context_tokens)
        a = (context, args.branches, args.max_tokens)
        naive, ref = run_naive(uncached, *a)
        lang, lang_texts = run_lang(cached, *a)
        naive_cache, _ = run_naive(cached, make_context(cached, r + 1000, args.context_tokens),
                                   args.branches, args.max_tokens)
        if lang_texts != ref:
            print(f"round {r}: lang's branches differ from the naive ones", file=sys.stderr)
        runs["naive"].append(naive)
        runs["lang"].append(lang)
        runs["naive+cache"].append(naive_cache)
        print(f"round {r}: " + "  ".join(
            f"{m} {v[-1]['prompt_tokens_computed']} tok {v[-1]['seconds']:.2f} s"
            for m, v in runs.items()), file=sys.stderr)

    med = {m: median_of(v) for m, v in runs.items()}
    base = med["naive"]
    result = {
        "config": vars(args), "machine": machine(), "median": med, "runs": runs,
        "prefill_reduction_x": base["prompt_tokens_computed"]
        / max(1, med["lang"]["prompt_tokens_computed"]),
        "speedup_x": base["seconds"] / med["lang"]["seconds"],
        "speedup_vs_naive_cache_x": med["naive+cache"]["seconds"] / med["lang"]["seconds"],
    }
    dump(args.out, result)


if __name__ == "__main__":
    main()
