"""Offline throughput on SmolLM2: N prompts x M greedy output tokens, Loom `LLM.generate` vs
transformers batched `generate` (left-padded batches), each in a fresh process, one run.

    .venv/bin/python benchmarks/bench_offline.py --num-prompts 256 --output-len 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dump, in_fresh_process, machine  # noqa: E402

from loom.threads import openmp_env_defaults  # noqa: E402

TOPICS = ["the ocean", "a city at night", "an old library", "mountain weather", "a chess game",
          "bread baking", "a train journey", "the moon", "a garden in spring", "a quiet village",
          "space travel", "a river", "honey bees", "a storm", "a lighthouse", "winter"]


def prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} (variant {i})." for i in range(n)]


def run_loom(n: int, m: int, quantization: str | None = None, cpu_kernels: str = "auto") -> dict:
    from loom import LLM, SamplingParams

    llm = LLM(seed=0, quantization=quantization, cpu_kernels=cpu_kernels)
    params = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts(n), params)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": toks, "output_tokens_per_s": toks / dt}


def run_transformers(n: int, m: int, batch: int) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loom.loader.resolve import default_gguf_path

    path = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ps = prompts(n)
    toks = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in tqdm(range(0, n, batch), desc="transformers"):
            enc = tok(ps[i : i + batch], return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            toks += (out.shape[1] - enc.input_ids.shape[1]) * out.shape[0]
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": toks, "output_tokens_per_s": toks / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--result-json", default=None)
    ap.add_argument("--loom-quantization", default=None,
                    choices=["none", "fp16", "int8", "int4"],
                    help="also run Loom with these weights (none: the fp32 reference)")
    ap.add_argument("--loom-cpu-kernels", default="auto",
                    help="with --loom-quantization: Loom's --cpu-kernels (default: auto)")
    args = ap.parse_args()
    # Loom's OpenMP defaults (loom/threads.py) take effect only if set before torch loads: its
    # children get them in their environment from the start
    loom_env = openmp_env_defaults()
    loom = in_fresh_process(run_loom, args.num_prompts, args.output_len, env=loom_env)
    quant = None
    if args.loom_quantization:
        quant = in_fresh_process(run_loom, args.num_prompts, args.output_len,
                                 args.loom_quantization, args.loom_cpu_kernels, env=loom_env)
    ref = in_fresh_process(run_transformers, args.num_prompts, args.output_len, args.hf_batch_size)
    dump(args.result_json, {
        "config": vars(args), "loom": loom, "transformers": ref,
        "throughput_ratio_loom_over_transformers":
            loom["output_tokens_per_s"] / ref["output_tokens_per_s"],
        "peak_memory_ratio_loom_over_transformers": loom["peak_rss_mib"] / ref["peak_rss_mib"],
        **({f"loom_{args.loom_quantization}": quant,
            f"throughput_ratio_loom_{args.loom_quantization}_over_transformers":
                quant["output_tokens_per_s"] / ref["output_tokens_per_s"]} if quant else {}),
        "machine": machine(),
    })


if __name__ == "__main__":
    main()
