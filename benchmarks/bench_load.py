"""Load time, peak memory and single-stream greedy tokens/s on the SmolLM2 GGUF:
Loom next to transformers, each in a fresh process, in the same run (medians of --repeats).

    .venv/bin/python benchmarks/bench_load.py --repeats 3 --tokens 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dump, in_fresh_process, machine, median_of  # noqa: E402

PROMPT = "The history of the city of Paris begins"


def run_loom(tokens: int) -> dict:
    start = time.perf_counter()
    from loom import LLM, SamplingParams

    llm = LLM(seed=0)
    load = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    gen = time.perf_counter() - t
    return {"load_s": load, "tokens_per_s": len(out.outputs[0].token_ids) / gen}


def run_transformers(tokens: int) -> dict:
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loom.loader.resolve import default_gguf_path

    path = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    load = time.perf_counter() - start
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    gen = time.perf_counter() - t
    return {"load_s": load, "tokens_per_s": (out.shape[1] - ids.shape[1]) / gen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args()
    results = {}
    for name, fn in (("loom", run_loom), ("transformers", run_transformers)):
        runs = []
        for i in range(args.repeats):
            print(f"[{name}] run {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
            runs.append(in_fresh_process(fn, args.tokens))
        results[name] = {"median": median_of(runs), "runs": runs}
    loom, ref = results["loom"]["median"], results["transformers"]["median"]
    results["ratios_loom_over_transformers"] = {k: loom[k] / ref[k] for k in loom}
    results["machine"] = machine()
    dump(args.result_json, results)


if __name__ == "__main__":
    main()
