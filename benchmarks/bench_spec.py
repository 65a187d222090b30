"""Single-stream speed with and without n-gram speculative decoding (docs/speculative.md).

Two workloads, one request at a time, greedy: copy-heavy (rewrite a given function with one
change; answer by quoting a given passage) and plain chat. For each: tok/s without and with
`--speculative-config`, the speedup, the acceptance rate (overall and per draft position) and
whether the outputs are identical (they must be, with --batch-invariant kernels).

    python benchmarks/bench_spec.py                  # the full run
    python benchmarks/bench_spec.py --smoke          # 1 prompt each, 16 tokens (checks it runs)
"""

from __future__ import annotations

import argparse
import json
import time

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

COPY = [
    f"Rewrite this Python function so that it raises TypeError when window is not an int. "
    f"Give the whole function.\n\n{FUNCTION}",
    f"Here is a passage:\n\n{PASSAGE}\n\nQuote, word for word, the sentence about the storm "
    f"and then the sentence about the keeper.",
    f"Rename the variable `total` to `running_sum` in this function and give the whole "
    f"function:\n\n{FUNCTION}",
]
CHAT = [
    "Give me three tips for sleeping better.",
    "Why is the sky blue? Answer in a short paragraph.",
    "Write a haiku about autumn.",
]


def run(llm, prompts: list[str], max_tokens: int):
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs, tokens, seconds = [], 0, 0.0
    for prompt in prompts:  # single stream: one request at a time
        start = time.perf_counter()
        out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
        outs.append(list(out.outputs[0].token_ids))
    return outs, tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max")
    ap.add_argument("--smoke", action="store_true", help="1 prompt per workload, 16 tokens")
    args = ap.parse_args()
    from loom.engine.llm import LLM

    workloads = {"copy": COPY, "chat": CHAT}
    if args.smoke:
        workloads = {name: prompts[:1] for name, prompts in workloads.items()}
        args.max_tokens = 16
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_max": args.lookup_max})
    results: dict[str, dict] = {name: {} for name in workloads}
    for label, config in (("base", None), ("ngram", spec)):
        llm = LLM(args.model, batch_invariant=True, speculative_config=config)
        for name, prompts in workloads.items():
            run(llm, prompts[:1], 8)  # warm-up
            before = _stats(llm)
            outs, tps = run(llm, prompts, args.max_tokens)
            results[name][label] = (outs, tps, _delta(before, _stats(llm)))
        del llm
    for name, r in results.items():
        (base_out, base_tps, _), (spec_out, spec_tps, st) = r["base"], r["ngram"]
        rate = st["accepted"] / st["proposed"] if st["proposed"] else 0.0
        per_pos = [round(a / p, 3) if p else 0.0 for a, p in zip(st["acc_pos"], st["prop_pos"])]
        print(json.dumps({
            "workload": name, "base_tok_s": round(base_tps, 2), "ngram_tok_s": round(spec_tps, 2),
            "speedup": round(spec_tps / base_tps, 3), "acceptance_rate": round(rate, 3),
            "acceptance_per_position": per_pos, "identical_output": base_out == spec_out,
        }))


def _stats(llm) -> dict:
    spec = llm.engine.scheduler.spec
    if spec is None:
        return {"proposed": 0, "accepted": 0, "acc_pos": [], "prop_pos": []}
    s = spec.stats
    return {"proposed": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
            "acc_pos": list(s.accepted_per_pos), "prop_pos": list(s.proposed_per_pos)}


def _delta(a: dict, b: dict) -> dict:
    def sub(x: list[int], y: list[int]) -> list[int]:
        return [v - (x[i] if i < len(x) else 0) for i, v in enumerate(y)]

    return {"proposed": b["proposed"] - a["proposed"], "accepted": b["accepted"] - a["accepted"],
            "acc_pos": sub(a["acc_pos"], b["acc_pos"]), "prop_pos": sub(a["prop_pos"], b["prop_pos"])}


if __name__ == "__main__":
    main()
