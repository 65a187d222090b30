"""Single-stream speed with and without n-gram speculative decoding (docs/speculative.md).

Two workloads, one request at a time, greedy, Loom's default kernels (`--batch-invariant` for
the fp32 ones): copy-heavy (tasks whose answer quotes the prompt: quote a passage, answer by
quoting it, copy a list, fix the spelling of a text, rewrite a function with one change) and
plain chat. Both engines live in this one process and run each prompt in turn (base, then
speculative, the order swapped every repeat), so a shared machine's load falls on both alike;
per prompt the median of `--repeats` runs counts. For each workload: tok/s without and with
`--speculative-config` (adaptive draft length; `--fixed` adds k drafts every step), the speedup
(and the decode's alone: the time after each request's first token),
the acceptance rate (overall and per draft position), the draft tokens a verify step and whether
the outputs are identical (they must be). `--prediction` adds the copy-heavy prompts with a
prediction (OpenAI's predicted outputs: the text each quotes or edits, as an editor would send it)
on a third engine without `--speculative-config`. `--self-prediction N` adds a workload that
needs no real weights (random-weight shapes of large models, hybrids): the copy-heavy prompts,
each with the base engine's own reply as its prediction, every N-th token of it changed (an
edit the reply departs from): how fast verify steps turn known text into tokens, an upper
bound for edits of that density.

    .venv/bin/python benchmarks/bench_spec.py --out benchmarks/results/spec-<date>-<machine>.json \
        --plot benchmarks/results/spec-<date>-<machine>.png
    .venv/bin/python benchmarks/bench_spec.py --smoke          # 1 prompt each, 16 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dump, machine  # noqa: E402

FUNCTION = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Its keeper, "
           "a quiet man named Elias, climbed the one hundred and twelve steps every evening "
           "to light the lamp, and every morning he wrote the weather in a leather book. "
           "When the storm of 1887 broke the glass, he kept the flame alive with his coat.")

PASSAGE_2 = ("The village below the cliff lived on fishing. Every boat carried a lantern "
             "painted with the family's colours, and on winter nights the harbour looked like "
             "a field of small stars. The children learned to read the sea before they learned "
             "to read books, and the old women mended nets on the steps of the church.")

COPY = [
    f"Quote the following passage word for word.\n\n{PASSAGE}\n\n{PASSAGE_2}",
    f"Passage:\n{PASSAGE}\n\nQuestion: What did Elias do every evening and every morning? "
    "Answer by quoting the passage.",
    "Copy this list exactly, one item per line:\n- apples: 3 kg\n- bread: 2 loaves\n"
    "- milk: 1 litre\n- eggs: 12\n- butter: 250 g\n- cheese: 400 g\n- rice: 1 kg\n"
    "- olive oil: 1 bottle",
    "Fix the spelling in this text and give it back in full: The quick brown fox jumpd over "
    "the lazy dog. The dog did not mind, becuase it was sleeping in the warm afternoon sun, "
    "and the fox ran off into the forest.",
    f"Here is a Python function:\n\n{FUNCTION}\nRewrite it with one change: rename the "
    "function to `rolling_mean`. Reply with the whole function only.",
]
# What an editor would send as the prediction (OpenAI's predicted outputs) with each copy-heavy
# prompt: the text being quoted, copied or edited (`--prediction`).
COPY_SOURCES = [
    f"{PASSAGE}\n\n{PASSAGE_2}",
    PASSAGE,
    COPY[2].split("\n", 1)[1],
    COPY[3].split(": ", 1)[1],
    FUNCTION,
]
CHAT = [
    "Give me three tips for sleeping better.",
    "Why is the sky blue? Answer in a short paragraph.",
    "Write a haiku about autumn.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small bakery and explain why.",
    "How do I boil an egg?",
]


def run_one(llm, prompt: str, max_tokens: int, prediction: str | None = None
            ) -> tuple[list[int], float, float]:
    """(output tokens, seconds, seconds after the first token: the decode alone)."""
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prediction=prediction)
    start = time.perf_counter()
    out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    m = out.metrics
    decode = (m.finished_time - m.first_token_time if m is not None and m.finished_time
              is not None and m.first_token_time is not None else float("nan"))
    return list(out.outputs[0].token_ids), seconds, decode


def measure(engines: dict, prompts: list[str], max_tokens: int, repeats: int,
            predictions: list | None = None) -> dict:
    """Per engine: outputs, tokens and the sum over prompts of the median seconds; the engines
    run each prompt in turn (the order reversed every repeat). The engine labelled
    "prediction" gets each prompt's prediction."""
    labels = list(engines)
    outs: dict[str, list[list[int]]] = {label: [] for label in labels}
    seconds = {label: 0.0 for label in labels}
    decode = {label: 0.0 for label in labels}
    for i, prompt in enumerate(prompts):
        times: dict[str, list[float]] = {label: [] for label in labels}
        decodes: dict[str, list[float]] = {label: [] for label in labels}
        for rep in range(repeats):
            for label in labels if rep % 2 == 0 else labels[::-1]:
                pred = predictions[i] if predictions and label == "prediction" else None
                tokens, t, d = run_one(engines[label], prompt, max_tokens, pred)
                times[label].append(t)
                decodes[label].append(d)
                if rep == 0:
                    outs[label].append(tokens)
        for label in labels:
            seconds[label] += statistics.median(times[label])
            decode[label] += statistics.median(decodes[label])
    return {label: {"outputs": outs[label], "seconds": seconds[label],
                    "decode_seconds": decode[label],
                    "tokens": sum(len(o) for o in outs[label])} for label in labels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per prompt and engine (median)")
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens (k + 1 rows a "
                    "verify step: up to 8 keep the default decode kernel)")
    ap.add_argument("--lookup-max", type=int, default=5, help="prompt_lookup_max")
    ap.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--row-cost", type=float, default=None,
                    help="row_cost of the adaptive draft length (default: unset, the engine's "
                    "measured step times)")
    ap.add_argument("--fixed", action="store_true",
                    help="also run k drafts every step (adaptive off) as a third engine")
    ap.add_argument("--prediction", action="store_true",
                    help="also run the copy-heavy prompts with a prediction (the text they "
                    "quote or edit; OpenAI's predicted outputs) on the engine without "
                    "--speculative-config")
    ap.add_argument("--self-prediction", type=int, default=0, metavar="N",
                    help="also run the copy-heavy prompts with the base engine's reply as "
                    "their prediction, every N-th token changed (workload 'self')")
    ap.add_argument("--workloads", default="copy,chat",
                    help="of copy, chat (comma-separated; 'self' comes with --self-prediction)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the batch-invariant fp32 kernels instead of Loom's defaults")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    ap.add_argument("--plot", default=None, help="draw tok/s per workload here (PNG)")
    ap.add_argument("--smoke", action="store_true", help="1 prompt per workload, 16 tokens")
    args = ap.parse_args()
    from loom.engine.llm import LLM

    workloads = {name: {"copy": COPY, "chat": CHAT}[name]
                 for name in args.workloads.split(",") if name}
    if args.self_prediction:
        workloads["self"] = COPY
    if args.smoke:
        workloads = {name: prompts[:1] for name, prompts in workloads.items()}
        args.max_tokens, args.repeats = 16, 1
    config = {"method": "ngram", "num_speculative_tokens": args.k,
              "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    adaptive = config if args.row_cost is None else dict(config, row_cost=args.row_cost)
    specs = [("base", None), ("ngram", json.dumps(adaptive))]
    if args.fixed:  # (row_cost is refused with adaptive off)
        specs.append(("fixed", json.dumps(dict(config, adaptive=False))))
    engines = {label: LLM(args.model, batch_invariant=args.batch_invariant,
                          speculative_config=spec) for label, spec in specs}
    for llm in engines.values():
        run_one(llm, CHAT[0], 8)  # warm-up
    results: dict[str, dict] = {}
    predictions = {"copy": COPY_SOURCES} if args.prediction else {}
    if args.self_prediction:  # the base engine's replies, every N-th token changed
        n = args.self_prediction
        predictions["self"] = [
            [t + 1 if (j + 1) % n == 0 else t
             for j, t in enumerate(run_one(engines["base"], p, args.max_tokens)[0])]
            for p in workloads["self"]]
    if predictions:  # an engine as "base" (predictions need no config), its own cache
        engines["prediction"] = LLM(args.model, batch_invariant=args.batch_invariant)
        run_one(engines["prediction"], CHAT[0], 8)
    for name, prompts in workloads.items():
        before = _stats(engines["ngram"])
        before_pred = _stats(engines["prediction"]) if "prediction" in engines else None
        runs = engines if name in predictions else {k: v for k, v in engines.items()
                                                    if k != "prediction"}
        r = measure(runs, prompts, args.max_tokens, args.repeats, predictions.get(name))
        st = _delta(before, _stats(engines["ngram"]))
        base_tps = r["base"]["tokens"] / r["base"]["seconds"]
        spec_tps = r["ngram"]["tokens"] / r["ngram"]["seconds"]
        results[name] = {
            "prompts": len(prompts), "tokens": r["base"]["tokens"],
            "base_tok_s": round(base_tps, 2), "ngram_tok_s": round(spec_tps, 2),
            "speedup": round(spec_tps / base_tps, 3),
            # the same, after each request's first token (its prompt step, the same work in
            # both engines, left out)
            "decode_speedup": round(r["base"]["decode_seconds"] / r["ngram"]["decode_seconds"], 3),
            "acceptance_rate": round(st["accepted"] / st["proposed"], 3) if st["proposed"] else 0.0,
            "accepted_per_verify_step": round(st["accepted"] / st["drafts"], 3)
            if st["drafts"] else 0.0,
            "acceptance_per_position": [round(a / p, 3)
                                        for a, p in zip(st["acc_pos"], st["prop_pos"]) if p],
            "draft_tokens_per_verify_step": round(st["proposed"] / st["drafts"], 3)
            if st["drafts"] else 0.0,
            "identical_output": r["base"]["outputs"] == r["ngram"]["outputs"],
        }
        if "fixed" in r:
            fixed_tps = r["fixed"]["tokens"] / r["fixed"]["seconds"]
            results[name].update({
                "fixed_k_tok_s": round(fixed_tps, 2),
                "fixed_k_speedup": round(fixed_tps / base_tps, 3),
                "fixed_k_decode_speedup": round(
                    r["base"]["decode_seconds"] / r["fixed"]["decode_seconds"], 3),
                "fixed_k_identical_output": r["base"]["outputs"] == r["fixed"]["outputs"]})
        if "prediction" in r:
            pred_tps = r["prediction"]["tokens"] / r["prediction"]["seconds"]
            sp = _delta(before_pred, _stats(engines["prediction"]))
            results[name].update({
                "prediction_acceptance_rate": round(sp["accepted"] / sp["proposed"], 3)
                if sp["proposed"] else 0.0,
                "prediction_accepted_per_verify_step": round(sp["accepted"] / sp["drafts"], 3)
                if sp["drafts"] else 0.0,
                "prediction_tok_s": round(pred_tps, 2),
                "prediction_speedup": round(pred_tps / base_tps, 3),
                "prediction_decode_speedup": round(
                    r["base"]["decode_seconds"] / r["prediction"]["decode_seconds"], 3),
                "prediction_identical_output": r["base"]["outputs"] == r["prediction"]["outputs"]})
    dump(args.out, {
        "machine": machine(), "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
        "kernels": "batch-invariant" if args.batch_invariant else "default",
        "speculative_config": config, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "self_prediction_every": args.self_prediction or None,
        "workloads": results,
    })
    if args.plot:
        _plot(results, args.plot, config)


def _plot(results: dict[str, dict], path: str, config: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    bars = [("base_tok_s", "without speculation", None),
            ("ngram_tok_s", f"n-gram, k={config['num_speculative_tokens']}", "speedup"),
            ("prediction_tok_s", "prediction (no config)", "prediction_speedup")]
    bars = [b for b in bars if any(b[0] in results[n] for n in names)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(bars)
    for j, (key, label, speedup) in enumerate(bars):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i, n in enumerate(names)
              if key in results[n]]
        ys = [results[n][key] for n in names if key in results[n]]
        ax.bar(xs, ys, width, label=label)
        if speedup is not None:
            for x, n in zip(xs, [n for n in names if key in results[n]]):
                ax.annotate(f"{results[n][speedup]:.2f}x", (x, results[n][key]), ha="center",
                            va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens/s, one stream")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(bars))  # off the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _stats(llm) -> dict:
    s = llm.engine.scheduler.spec.stats
    return {"drafts": s.num_drafts, "proposed": s.num_draft_tokens,
            "accepted": s.num_accepted_tokens, "acc_pos": list(s.accepted_per_pos),
            "prop_pos": list(s.proposed_per_pos)}


def _delta(a: dict, b: dict) -> dict:
    def sub(x: list[int], y: list[int]) -> list[int]:
        return [v - (x[i] if i < len(x) else 0) for i, v in enumerate(y)]

    return {"drafts": b["drafts"] - a["drafts"], "proposed": b["proposed"] - a["proposed"],
            "accepted": b["accepted"] - a["accepted"],
            "acc_pos": sub(a["acc_pos"], b["acc_pos"]),
            "prop_pos": sub(a["prop_pos"], b["prop_pos"])}


if __name__ == "__main__":
    main()
