"""K-quant linears past 8 rows: the default kernel (csrc/linear_kq_gemm.c) against the integer
kernel in chunks of 8 rows (what ran before, and what --batch-invariant runs), on one loaded
model in one process, interleaved rounds, medians.

    .venv/bin/python benchmarks/bench_kq_gemm.py MODEL.gguf [--prompt 128 --streams 16
        --tokens 16 --rounds 3 --threads N]

Prompt: LLM.generate of one fresh random `--prompt`-token prompt, one output token (~TTFT; a
new prompt each round: no prefix-cache hit). Streams: `--streams` random 16-token prompts, 1 and
then 1 + `--tokens` greedy tokens each; (second - first) / tokens is a decode step of all
streams (~TPOT), and streams / step their tokens a second.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from loom.engine.llm import LLM
from loom.quant.kquant import KQuantLinear
from loom.sampling_params import SamplingParams


def set_kernel(llm: LLM, kernel: str) -> None:
    """Every K-quant linear's kernel past 8 rows; the C stack rebuilds its codes."""
    model = llm.engine.runner.model
    for m in model.modules():
        if isinstance(m, KQuantLinear):
            m.batch_kernel = kernel
    stack = getattr(model.model, "stack", None)
    if stack:
        stack.cache = None  # rebuilt (with its `kernel` code) on the next step
        stack.head_module = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch's (the kernels') threads")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model)
    default = llm.engine.runner.model.model.layers[0].self_attn.o_proj
    kernels = {f"default ({getattr(default, 'batch_kernel', '?')} past 8 rows)":
               getattr(default, "batch_kernel", "int"), "integer in chunks of 8 (before)": "int"}
    vocab = llm.engine.runner.model_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, min(vocab, 30000)) for _ in range(length)] for _ in range(n)]

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    more = SamplingParams(temperature=0.0, max_tokens=1 + a.tokens, ignore_eos=True)
    ttft: dict[str, list[float]] = {k: [] for k in kernels}
    step: dict[str, list[float]] = {k: [] for k in kernels}
    for name, kernel in kernels.items():  # warm-up
        set_kernel(llm, kernel)
        llm.generate(prompts(a.streams, 16), one, use_tqdm=False)
    for _ in range(a.rounds):
        for name, kernel in kernels.items():
            set_kernel(llm, kernel)
            t = time.perf_counter()
            llm.generate(prompts(1, a.prompt), one, use_tqdm=False)
            ttft[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate(prompts(a.streams, 16), one, use_tqdm=False)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate(prompts(a.streams, 16), more, use_tqdm=False)
            step[name].append(((time.perf_counter() - t) - t1) / a.tokens)
    print(f"{a.model}: {a.prompt}-token prompt, {a.streams} streams x {a.tokens} tokens, "
          f"{a.rounds} rounds")
    for name in kernels:
        s = statistics.median(step[name])
        print(f"{name:34s} prompt {1e3 * statistics.median(ttft[name]):7.0f} ms "
              f"({', '.join(f'{1e3 * x:.0f}' for x in ttft[name])}); {a.streams}-stream step "
              f"{1e3 * s:6.0f} ms = {a.streams / s:6.2f} tok/s "
              f"({', '.join(f'{1e3 * x:.0f}' for x in step[name])})")


if __name__ == "__main__":
    main()
